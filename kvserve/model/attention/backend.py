"""The attention backend interface: how one layer attends over the paged KV cache.

A runner picks one backend for its model, once (`select_attention_backend`),
from the device, the KV dtype, the layer shape and the kernel switches; every
attention layer then calls it with the step's `AttentionMetadata`. A backend
owns the whole per-layer job: planning the step (cached on the metadata, so
the layers of one group plan once), storing this step's K/V in the cache and
attending, in the order the plan asks for (see `metadata`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvserve.model.attention.metadata import AttentionMetadata, AttentionPlan


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's fixed attention settings."""

    scale: float
    softcap: float | None = None  # tanh soft-capping of the scores (Gemma-2)
    sliding_window: int | None = None  # None: full attention
    # gpt-oss: one learned logit per query head [heads] that joins each softmax's denominator
    # (a key no value belongs to); None: no sink.
    sinks: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Stores a step's K/V and computes attention for one layer; stateless, shared by all layers."""

    name: str = "abstract"
    # Whether `plan` hands the short queries to the native kernel (`AttentionPlan.native`).
    plans_native_queries: bool = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens (already rotated) -> [T, Hq, D];
        this step's K/V end up in `kv_cache` [2, Hkv, blocks, block_size, D]."""
        plan = self.plan(metadata, kv_cache, params)
        if plan.write_before_read:
            self.store(kv_cache, k, v, plan)
        out = self.attend(q, k, v, kv_cache, plan, params)
        if not plan.write_before_read:
            self.store(kv_cache, k, v, plan)
        return out

    def plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, params: AttentionParams) -> AttentionPlan:
        """The step's plan for layers of this cache's block size and this window (built once per group)."""
        return metadata.plan(kv_cache.shape[3], params.sliding_window, self.plans_native_queries)

    @abstractmethod
    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
        """Write this step's K/V (the plan's tokens) into their cache slots."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               plan: AttentionPlan, params: AttentionParams) -> torch.Tensor:
        """Attention output [T, Hq, D] of every token of the plan."""
