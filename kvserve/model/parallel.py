"""Tensor-parallel-aware layers.

Every layer takes the full (unsharded) checkpoint tensor in `load_weight` and
keeps the slice that belongs to its rank, so the same loader works for any
tp_size. With tp_size 1 the collectives are skipped; with tp_size > 1 they use
the default torch.distributed process group unless one is given.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.native import cpu_kernels
from kvserve.model import quantized, stored_parts, stored_weight, workspace
from kvserve.model.quantized import QuantizationError, QuantizedWeight
from kvserve.model.stored_parts import StoredParts
from kvserve.model.stored_weight import StoredWeight

# A module's quantized weight: repacked for the older kernel, or as the file stores it.
HeldWeight = QuantizedWeight | StoredWeight | StoredParts


@dataclass(frozen=True)
class TPContext:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank {self.rank} out of range for tp_size {self.size}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def gather_last_dim_to_driver(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's shard on rank 0 (the driver); None on the other ranks."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.rank != 0:
            torch.distributed.gather(tensor, None, dst=self._global_rank(0), group=self.group)
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        torch.distributed.gather(tensor, parts, dst=self._global_rank(0), group=self.group)
        return torch.cat(parts, dim=-1)

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return torch.distributed.get_global_rank(self.group, group_rank)


def cpu_weight_packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold linear weights pre-packed for this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class QuantizedWeightMixin:
    """Modules whose weight may be held block-quantized (`quant_weight`) instead of as a
    float parameter: as the GGUF file stores it (`StoredWeight`, model/stored_weight.py;
    fused parts as `StoredParts`) or repacked for the older kernel (`QuantizedWeight`,
    model/quantized.py).

    The loader hands over each checkpoint part with `load_quantized`; once all are
    in, `finish_quantized` stacks them into `quant_weight` and drops the float
    parameter (the weight is held once): stored parts side by side, each as stored;
    repacked parts concatenated, those of fewer bits widened to the widest part's (a
    stored part next to a repacked one is repacked too). Parts that cannot be stacked
    (different widths) are dequantized into the float weight instead.
    """

    quant_weight: HeldWeight | None = None
    _quant_parts: dict[str | None, QuantizedWeight | StoredWeight] | None = None

    def load_quantized(self, weight: QuantizedWeight | StoredWeight, shard: str | None = None) -> None:
        """Keep this rank's part of a quantized checkpoint tensor (one fused part)."""
        if self._quant_parts is None:
            self._quant_parts = {}
        key = shard if shard is not None else self._part_names()[0]
        self._quant_parts[key] = self._rank_rows(weight, key)

    def _rank_rows(self, weight: QuantizedWeight, shard: str | None) -> QuantizedWeight:
        return weight

    def _part_names(self) -> list[str | None]:
        return [None]

    def finish_quantized(self) -> None:
        """Stack the loaded parts into `quant_weight` (or dequantize them, see the class)."""
        parts, self._quant_parts = self._quant_parts, None
        if not parts:
            return
        names = self._part_names()
        if set(parts) == set(names):
            ordered = [parts[name] for name in names]
            try:
                if all(isinstance(part, StoredWeight) for part in ordered):
                    self.quant_weight = stored_parts.stack(ordered)
                else:
                    self.quant_weight = quantized.cat_rows([_repacked(part) for part in ordered])
                self.register_parameter("weight", None)
                return
            except QuantizationError:
                pass
        for shard, part in parts.items():
            self.load_weight("weight", part.dequantize(), shard)


def _repacked(weight: QuantizedWeight | StoredWeight) -> QuantizedWeight:
    """`weight` in the older kernel's layout (a StoredWeight repacked, exactly)."""
    if isinstance(weight, QuantizedWeight):
        return weight
    return quantized.from_gguf_blocks(weight.type_name, weight.blocks.numpy(), weight.in_features)


class PackableLinearMixin(QuantizedWeightMixin):
    """Linear layers whose weight can be re-laid out once for oneDNN's CPU matmul.

    `F.linear` on CPU goes through MKL, which re-reads the weight in its plain
    layout every call (and on AMD CPUs takes slow paths); a weight packed once
    by oneDNN runs the decode/prefill matmuls 1.5-3x faster. After packing the
    plain weight is dropped (`weight` is None) unless `keep_plain`: then a
    batch of up to `SMALL_LINEAR_MAX_ROWS` rows runs through the native
    small-batch kernel over the plain weight (the single-stream decode step is
    a stream over the weights, which oneDNN's packed path reads at about half
    the memory bandwidth), at the price of holding both copies. Packed, the
    module can no longer be re-loaded or saved, only run.

    Float32 weights may instead be packed into panels for the native float32
    matmul (`pack_panels`, csrc/linear/f32_gemm.c), which runs every step size and the
    native decoder's steps of many tokens from the one copy.
    """

    packed_weight: torch.Tensor | None = None
    small_batch_kernel: bool = False
    panel_weight: torch.Tensor | None = None  # [ceil(out / 16), in, 16] (cpu_kernels.pack_f32_panels)
    panel_isa: int = -1  # the float32 panel matmul's path (quant_linear.c's codes)
    panel_out: int = 0  # output rows of the panel weight

    def pack_weight(self, keep_plain: bool = False) -> None:
        plain = self.weight.detach().contiguous()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(plain)
        if keep_plain:
            self.weight.data = plain
            self.small_batch_kernel = True
        else:
            self.register_parameter("weight", None)

    def pack_panels(self, isa: int) -> None:
        """Hold the float32 weight only in the panel layout of the native float32 matmul,
        run on path `isa`; the plain weight is dropped (the module then only runs)."""
        weight = self.weight.detach()
        self.panel_weight = cpu_kernels.pack_f32_panels(weight.contiguous())
        self.panel_isa, self.panel_out = isa, weight.shape[0]
        self.register_parameter("weight", None)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, num_draft_rows: int = 0,
                role: str | None = None) -> torch.Tensor:
        """x @ W^T (+ bias); `num_draft_rows` of x's rows are speculative drafts (see `quantized.linear`).
        `role`: a many-token step of float32 rows over a weight held as stored writes the product
        into that role's reused buffer (model/workspace.py), dead by the next request for the role."""
        out = workspace.scratch_for(x, role, self.quant_weight.out_features) \
            if isinstance(self.quant_weight, StoredWeight) else None
        if out is not None:
            return stored_weight.linear(x, self.quant_weight, bias, num_draft_rows=num_draft_rows, out=out)
        if isinstance(self.quant_weight, StoredParts):
            return stored_parts.linear(x, self.quant_weight, bias, num_draft_rows=num_draft_rows)
        if self.quant_weight is not None:
            return quantized.linear(x, self.quant_weight, bias, num_draft_rows=num_draft_rows)
        if self.panel_weight is not None:
            return cpu_kernels.f32_gemm(x, self.panel_weight, self.panel_out, self.panel_isa, bias)
        if self.packed_weight is not None:
            if self.small_batch_kernel and x.dim() == 2 and x.shape[0] <= cpu_kernels.SMALL_LINEAR_MAX_ROWS \
                    and x.stride(-1) == 1:
                return cpu_kernels.small_linear(x, self.weight, bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def kv_heads_per_rank(num_kv_heads: int, tp: TPContext) -> tuple[int, int]:
    """(KV heads each rank holds, ranks that hold the same heads).

    With at least as many KV heads as ranks the heads are split; with fewer,
    each rank holds one head, replicated on tp_size / num_kv_heads ranks, so
    that every rank's query heads find their KV head locally.
    """
    if num_kv_heads >= tp.size:
        return _split(num_kv_heads, tp, "num_kv_heads"), 1
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp.size} is not a multiple of num_kv_heads {num_kv_heads}")
    return 1, tp.size // num_kv_heads


def _split(total: int, tp: TPContext, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {tp.size}")
    return total // tp.size


class ColumnParallelLinear(PackableLinearMixin, nn.Module):
    """y = x W^T + b with W's output rows split across ranks; the output stays sharded.

    `output_sizes` lists the fused sub-matrices (e.g. q, k, v or gate, up): each
    is split on its own so rank r holds slice r of every part, contiguous.
    `replicas[i]` > 1 means part i is cut into tp_size / replicas[i] slices,
    each held by that many consecutive ranks (KV heads fewer than ranks).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPContext,
                 shard_names: list[str] | None = None, replicas: list[int] | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.full_sizes = list(output_sizes)
        self.replicas = list(replicas or [1] * len(output_sizes))
        self.shard_sizes = [_split(size * copies, tp, "output size")
                            for size, copies in zip(output_sizes, self.replicas)]
        self.shard_names = shard_names or [str(i) for i in range(len(output_sizes))]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def _offset(self, shard: str) -> tuple[int, int, int, int]:
        """(start in the fused output, slice size, full size, first row of this rank's slice)."""
        index = self.shard_names.index(shard)
        size = self.shard_sizes[index]
        source_row = (self.tp.rank // self.replicas[index]) * size
        return sum(self.shard_sizes[:index]), size, self.full_sizes[index], source_row

    def shard_rows(self, shard: str | None = None) -> tuple[int, int]:
        """(first row, row count) of the checkpoint tensor this rank keeps, for loaders
        that read only their slice."""
        _, size, _, source_row = self._offset(shard if shard is not None else self.shard_names[0])
        return source_row, size

    def load_weight(self, param_kind: str, full: torch.Tensor, shard: str | None = None) -> None:
        """Copy this rank's rows of `full` (weight or bias of one fused part).

        `full` may already be this rank's slice (a loader that reads only its rows).
        """
        shard = shard if shard is not None else self.shard_names[0]
        start, size, full_size, source_row = self._offset(shard)
        if full.shape[0] == full_size:
            rows = full[source_row:source_row + size]
        elif full.shape[0] == size and size != full_size:
            rows = full
        else:
            raise ValueError(f"{shard}: expected {full_size} rows, got {tuple(full.shape)}")
        target = self.weight if param_kind == "weight" else self.bias
        target.data[start:start + size].copy_(rows)

    def _rank_rows(self, weight: QuantizedWeight, shard: str | None) -> QuantizedWeight:
        shard = shard if shard is not None else self.shard_names[0]
        _, size, full_size, source_row = self._offset(shard)
        return weight.rows(slice(source_row, source_row + size)) if weight.out_features == full_size else weight

    def _part_names(self) -> list[str | None]:
        return list(self.shard_names)

    def forward(self, x: torch.Tensor, num_draft_rows: int = 0) -> torch.Tensor:
        return self._matmul(x, self.bias, num_draft_rows)


class RowParallelLinear(PackableLinearMixin, nn.Module):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.shard_input = _split(input_size, tp, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.shard_input), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None

    def shard_columns(self) -> tuple[int, int]:
        """(first column, column count) of the checkpoint weight this rank keeps."""
        return self.tp.rank * self.shard_input, self.shard_input

    def load_weight(self, param_kind: str, full: torch.Tensor, shard: str | None = None) -> None:
        """Copy this rank's columns of `full` (or `full` itself if it is already the slice)."""
        if param_kind == "bias":
            self.bias.data.copy_(full)
            return
        if full.shape[1] == self.input_size:
            start = self.tp.rank * self.shard_input
            full = full[:, start:start + self.shard_input]
        self.weight.data.copy_(full)

    def _rank_rows(self, weight: QuantizedWeight, shard: str | None) -> QuantizedWeight:
        if weight.in_features != self.shard_input:  # the loader cuts the columns before repacking
            raise QuantizationError(f"quantized weight of width {weight.in_features}, rank holds {self.shard_input}")
        return weight

    def forward(self, x: torch.Tensor, num_draft_rows: int = 0, role: str | None = None) -> torch.Tensor:
        """`role`: as `_matmul`'s (a reused output buffer for many-token steps)."""
        out = self.tp.all_reduce(self._matmul(x, num_draft_rows=num_draft_rows, role=role))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(QuantizedWeightMixin, nn.Module):
    """Embedding whose vocabulary rows are split across ranks (padded to divide evenly)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_vocab = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_vocab
        # Not zeros: a quantized table replaces it untouched (zeroing would make its pages resident).
        self.weight = nn.Parameter(torch.empty(self.shard_vocab, hidden_size), requires_grad=False)

    def shard_rows(self, shard: str | None = None) -> tuple[int, int]:
        """(first row, row count) of the checkpoint matrix this rank keeps (the last may be short)."""
        start = min(self.vocab_start, self.vocab_size)
        return start, min(self.vocab_start + self.shard_vocab, self.vocab_size) - start

    def load_weight(self, param_kind: str, full: torch.Tensor, shard: str | None = None) -> None:
        """Copy this rank's vocabulary rows of `full` (or `full` itself if it is already the slice)."""
        start, count = self.shard_rows()
        rows = full[start:start + count] if full.shape[0] == self.vocab_size else full
        if rows.shape[0] != count:
            raise ValueError(f"embedding: expected {self.vocab_size} rows, got {tuple(full.shape)}")
        self.weight.data[:count].copy_(rows)
        self.weight.data[count:].zero_()  # the padded vocabulary

    def _rank_rows(self, weight: QuantizedWeight, shard: str | None) -> QuantizedWeight:
        start, count = self.shard_rows()
        rows = weight.rows(slice(start, start + count)) if weight.out_features == self.vocab_size else weight
        if rows.out_features != count:
            raise QuantizationError(f"embedding: expected {self.vocab_size} rows, got {weight.out_features}")
        padding = self.shard_vocab - count  # zero rows (d = m = 0) for the padded vocabulary
        if padding and isinstance(rows, StoredWeight):  # zero bytes: every GGUF block type's zero
            rows = dataclasses.replace(rows, blocks=F.pad(rows.blocks, (0, 0, 0, padding)))
        elif padding:
            rows = dataclasses.replace(rows, qs=F.pad(rows.qs, (0, 0, 0, padding)),
                                       d=F.pad(rows.d, (0, 0, 0, padding)), m=F.pad(rows.m, (0, 0, 0, padding)))
        return rows

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_weight is not None:
            return self.quant_weight.dequantize(ids.reshape(-1)).view(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of `input_ids` (float32 when the table is held quantized)."""
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_vocab)
        embedded = self._lookup(local.masked_fill(outside, 0))
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(embedded)


class ParallelLMHead(PackableLinearMixin, VocabParallelEmbedding):
    """The output projection, vocabulary-sharded; logits are gathered to full width."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        if tied_to is not None:
            self.weight = tied_to.weight

    def logits(self, hidden: torch.Tensor, num_draft_rows: int = 0) -> torch.Tensor:
        local = self._matmul(hidden, num_draft_rows=num_draft_rows)
        return self.tp.all_gather_last_dim(local)[..., :self.vocab_size]

    def logits_on_driver(self, hidden: torch.Tensor, num_draft_rows: int = 0) -> torch.Tensor | None:
        """Full-width logits on rank 0 only (the rank that samples); None elsewhere."""
        gathered = self.tp.gather_last_dim_to_driver(self._matmul(hidden, num_draft_rows=num_draft_rows))
        return None if gathered is None else gathered[..., :self.vocab_size]
