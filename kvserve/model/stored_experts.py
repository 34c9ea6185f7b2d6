"""A mixture-of-experts layer's routed experts run in one native call (#28) where every expert's
projections are GGUF blocks as stored (`StoredWeight`, views of the file's mapping).

`StoredExperts` holds a table of each expert's gate, up and down blocks (addresses and ggml
types) for csrc/linear/moe_experts.c, which groups the step's (token, slot) pairs by expert,
runs every chosen expert's SiLU-gated MLP through the same row kernels as a dense layer
(kvserve_gguf_rows) and sums the weighted outputs, bit for bit as the per-op path
(`SparseMoeBlock` expert by expert) does: the Python overhead per active expert (gather,
three matmuls, SiLU*up, scale, scatter-add) becomes one call per layer. It takes the
experts the per-op path would run through the row kernel and the native gated product:
SiLU-gated, or gpt-oss's clamped SwiGLU with its biases; float32 activations; steps of
any size where every expert type has the native GEMM on the path (Q4_K, Q6_K, Q8_0, Q5_0 on AVX-512
VNNI: csrc/linear/gguf_gemm.c, whose rows keep their batch-one sums, as the per-op path's
`stored_weight.linear` does at any size), else steps of fewer rows than the weights' dense-GEMM
threshold (from it the per-op path dequantizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model import stored_weight, workspace
from kvserve.model.stored_parts import StoredParts
from kvserve.model.stored_weight import StoredWeight
from kvserve.native import cpu_kernels
from kvserve.native import isa as isa_table


@dataclass
class StoredExperts:
    """The experts' blocks: `table` int64 [experts, 9] (gate blocks, gate type, up blocks, up
    type, down blocks, down type, then the gate, up and down biases' addresses, 0: none),
    `weights` the StoredWeights and biases it points into (held so that they stay alive),
    `width` the expert width (this rank's), `isa` the kernel path, `gemm_rows` the weights'
    dense-GEMM threshold (0: never), `swiglu` gpt-oss's (limit, alpha) or None: SiLU,
    `native_gemm` whether every expert type has the native GEMM (then no threshold applies)."""

    table: torch.Tensor
    weights: list[StoredWeight]
    width: int
    hidden: int
    isa: str
    gemm_rows: int
    swiglu: tuple[float, float] | None = None
    native_gemm: bool = False

    def takes(self, x: torch.Tensor) -> bool:
        """Whether a step of activations x runs here (as the per-op path's row kernel would)."""
        return (x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] == self.hidden
                and (not self.gemm_rows or x.shape[0] < self.gemm_rows or self.native_gemm))

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, gate_weights: torch.Tensor) -> torch.Tensor:
        """sum_k gate_weights[:, k] * expert_{ids[:, k]}(x) [T, hidden], unreduced across ranks."""
        ids = expert_ids.to(torch.int64).contiguous()
        weights = gate_weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        lib = stored_weight._lib()
        scratch, scratch_bytes = None, 0  # a few rows: the call's own small buffers
        if x.shape[0] >= workspace.MIN_ROWS:
            scratch_bytes = lib.kvserve_moe_experts_workspace(x.shape[0], ids.shape[1], self.hidden, self.width)
            scratch = workspace.scratch("moe_experts", 1, scratch_bytes, torch.uint8).data_ptr()
        code = lib.kvserve_moe_experts(
            x.data_ptr(), x.shape[0], self.hidden, ids.data_ptr(), weights.data_ptr(), ids.shape[1],
            self.table.data_ptr(), self.table.shape[0], self.width, int(self.swiglu is not None),
            *(self.swiglu or (0.0, 0.0)), out.data_ptr(), isa_table.ISA_CODES[self.isa], torch.get_num_threads(),
            scratch, scratch_bytes)
        if code == -2:
            raise cpu_kernels.KernelArgumentError(f"the {self.isa} path of the GGUF kernels does not run on this CPU")
        if code:
            raise cpu_kernels.KernelArgumentError(f"the stored-experts kernel rejected its arguments (code {code})")
        return out


def gate_and_up(weight) -> tuple[StoredWeight, StoredWeight] | None:
    """An expert's fused gate/up weight as its (gate, up) StoredWeights, or None where it is not
    two stored halves of one width."""
    if isinstance(weight, StoredParts) and len(weight.parts) == 2:
        gate, up = weight.parts
    elif isinstance(weight, StoredWeight) and weight.out_features % 2 == 0:
        half = weight.out_features // 2
        gate, up = weight.rows(slice(0, half)), weight.rows(slice(half, None))
    else:
        return None
    return (gate, up) if gate.out_features == up.out_features else None


def _bias(linear, tp_rank_adds: bool = True) -> torch.Tensor | None:
    """A projection's float32 bias as the per-op path adds it (None: none, or not on this rank)."""
    bias = linear.bias if tp_rank_adds else None
    return None if bias is None else bias.detach()


def stored_experts(experts) -> StoredExperts | None:
    """The table of `experts` (GatedMLPs), or None where one of them cannot run in the native
    call: not SiLU-gated or gpt-oss's SwiGLU with the native gated product, a projection not
    held as stored, a bias that is not float32, or kernel choices that differ between them."""
    rows, held, gating = [], [], set()
    for expert in experts:
        halves = gate_and_up(expert.gate_up_proj.quant_weight)
        down = expert.down_proj.quant_weight
        if halves is None or not isinstance(down, StoredWeight) or not expert.native:
            return None
        if expert.is_silu:
            gating.add(None)
        elif expert.swiglu_limit is not None:
            gating.add((float(expert.swiglu_limit), float(expert.swiglu_alpha)))
        else:
            return None
        gate, up = halves
        if gate.in_features != down.out_features or down.in_features != gate.out_features:
            return None
        gate_up_bias = _bias(expert.gate_up_proj)
        down_bias = _bias(expert.down_proj, expert.down_proj.tp.rank == 0)  # added once, on rank 0
        biases = [None, None] if gate_up_bias is None else list(gate_up_bias.chunk(2))
        biases.append(down_bias)
        if any(b is not None and (b.dtype != torch.float32 or not b.is_contiguous()) for b in biases):
            return None
        held += [gate, up, down] + [b for b in biases if b is not None]
        rows.append([value for w in (gate, up, down) for value in (w.blocks.data_ptr(), w.ggml_type)]
                    + [0 if b is None else b.data_ptr() for b in biases])
    if not rows or len(gating) != 1:
        return None
    stored = [w for w in held if isinstance(w, StoredWeight)]
    choices = {(w.isa, w.gemm_rows) for w in stored}
    if len(choices) != 1:
        return None
    isa, gemm_rows = choices.pop()
    isa = isa or stored_weight._default_isa()
    if not all(stored_weight.supported(w.type_name, isa) for w in stored):
        return None
    return StoredExperts(torch.tensor(rows, dtype=torch.int64), held, stored[0].out_features,
                         stored[0].in_features, isa, gemm_rows, gating.pop(),
                         all(stored_weight.has_native_gemm(w, isa) for w in stored))
