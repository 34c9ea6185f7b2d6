"""Tensor-parallel-aware layers.

Every layer takes the full (unsharded) checkpoint tensor in `load_weight` and
keeps the slice that belongs to its rank, so the same loader works for any
tp_size. With tp_size 1 the collectives are skipped; with tp_size > 1 they use
the default torch.distributed process group unless one is given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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


def _split(total: int, tp: TPContext, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {tp.size}")
    return total // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; the output stays sharded.

    `output_sizes` lists the fused sub-matrices (e.g. q, k, v or gate, up): each
    is split on its own so rank r holds slice r of every part, contiguous.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, tp: TPContext,
                 shard_names: list[str] | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.full_sizes = list(output_sizes)
        self.shard_sizes = [_split(size, tp, "output size") for size in output_sizes]
        self.shard_names = shard_names or [str(i) for i in range(len(output_sizes))]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def _offset(self, shard: str) -> tuple[int, int, int]:
        index = self.shard_names.index(shard)
        return sum(self.shard_sizes[:index]), self.shard_sizes[index], self.full_sizes[index]

    def load_weight(self, param_kind: str, full: torch.Tensor, shard: str | None = None) -> None:
        """Copy this rank's rows of `full` (weight or bias of one fused part)."""
        shard = shard if shard is not None else self.shard_names[0]
        start, size, full_size = self._offset(shard)
        if full.shape[0] != full_size:
            raise ValueError(f"{shard}: expected {full_size} rows, got {tuple(full.shape)}")
        target = self.weight if param_kind == "weight" else self.bias
        rows = full[self.tp.rank * size:(self.tp.rank + 1) * size]
        target.data[start:start + size].copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.shard_input = _split(input_size, tp, "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.shard_input), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None

    def load_weight(self, param_kind: str, full: torch.Tensor, shard: str | None = None) -> None:
        if param_kind == "bias":
            self.bias.data.copy_(full)
            return
        start = self.tp.rank * self.shard_input
        self.weight.data.copy_(full[:, start:start + self.shard_input])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks (padded to divide evenly)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_vocab = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_vocab
        self.weight = nn.Parameter(torch.zeros(self.shard_vocab, hidden_size), requires_grad=False)

    def load_weight(self, param_kind: str, full: torch.Tensor, shard: str | None = None) -> None:
        rows = full[self.vocab_start:self.vocab_start + self.shard_vocab]
        self.weight.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_vocab)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(embedded)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocabulary-sharded; logits are gathered to full width."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPContext, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        if tied_to is not None:
            self.weight = tied_to.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        return self.tp.all_gather_last_dim(local)[..., :self.vocab_size]
