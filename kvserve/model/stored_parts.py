"""A fused projection (q, k, v; gate, up) whose parts are held as their GGUF file stores them.

A llama.cpp file stores each part as its own tensor, and a mixed-type file gives them different
block types (Q4_K_M: Q4_K queries and keys next to a Q6_K value projection), so their rows cannot
be one matrix of one block type. `StoredParts` stacks the parts' `StoredWeight`s by rows without
copying any of them: the per-op path multiplies each part and concatenates the outputs (each part
rounds the same activations the same way, so the result is that of one stacked matrix); the native
decoder takes the parts in one NativeLinear and gives each thread rows across them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvserve.model import quantized, stored_weight, workspace
from kvserve.model.stored_weight import StoredWeight


@dataclass
class StoredParts:
    """`parts` (StoredWeights of one width) stacked by rows, in order."""

    parts: list[StoredWeight]

    act_bits = 8  # as StoredWeight's: the kernels round activations to int8 per 32 columns

    def __post_init__(self) -> None:
        if len({p.in_features for p in self.parts}) != 1:
            raise quantized.QuantizationError("fused parts differ in width")

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    # The kernel choices, stamped alike on every part (`replace_parts`).
    @property
    def isa(self) -> str | None:
        return self.parts[0].isa

    @property
    def gemm_rows(self) -> int:
        return self.parts[0].gemm_rows

    @property
    def gemm_dtype(self) -> torch.dtype:
        return self.parts[0].gemm_dtype

    @property
    def type_name(self) -> str:
        return "+".join(dict.fromkeys(p.type_name for p in self.parts))

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)

    def replace_parts(self, **changes) -> "StoredParts":
        """The same parts with `changes` (kernel choices) made to each."""
        return StoredParts([dataclasses.replace(p, **changes) for p in self.parts])

    def dequantize(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 values of all rows (or of the rows `index`)."""
        values = torch.cat([p.dequantize() for p in self.parts])
        return values if index is None else values[index]


def stack(parts: list[StoredWeight]) -> StoredWeight | StoredParts:
    """One part as itself, more as their `StoredParts`."""
    return parts[0] if len(parts) == 1 else StoredParts(list(parts))


def linear(x: torch.Tensor, weight: StoredParts, bias: torch.Tensor | None = None,
           num_draft_rows: int = 0) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias), part by part (see `quantized.linear`)."""
    return torch.cat(part_outputs(x, weight, bias, num_draft_rows), dim=-1)


def part_outputs(x: torch.Tensor, weight: StoredParts, bias: torch.Tensor | None = None, num_draft_rows: int = 0,
                 roles: tuple[str, ...] | None = None) -> list[torch.Tensor]:
    """Each part's x @ W_part^T (+ its bias) apart, not concatenated. With `roles` (float32 x
    [rows, in] of at least `workspace.MIN_ROWS` rows), part i is written into the reused buffer
    of roles[i] (model/workspace.py): it is dead by the next step that asks for that role."""
    outputs, start = [], 0
    for i, part in enumerate(weight.parts):
        part_bias = None if bias is None else bias[start:start + part.out_features]
        out = workspace.scratch_for(x, None if roles is None else roles[i], part.out_features)
        outputs.append(stored_weight.linear(x, part, part_bias, num_draft_rows=num_draft_rows, out=out))
        start += part.out_features
    return outputs
