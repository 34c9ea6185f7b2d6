"""Attention over a paged KV cache, by job: `metadata` (the step's per-group view and
plan), `backend` (the interface a layer calls), `torch_backend` and
`cpu_native_backend` (its implementations) and `selector` (the once-per-runner
choice). The KV tensors themselves belong to the worker (`kvserve.worker.kv_tensors`)."""
from kvserve.model.attention.backend import AttentionBackend, AttentionParams
from kvserve.model.attention.cpu_native_backend import CpuNativeAttentionBackend
from kvserve.model.attention.metadata import (AttentionMetadata, AttentionPlan, StateMetadata, compute_slot_mapping,
                                              is_windowed, token_positions)
from kvserve.model.attention.selector import select_attention_backend
from kvserve.model.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionParams", "AttentionPlan", "CpuNativeAttentionBackend",
           "StateMetadata", "TorchAttentionBackend", "compute_slot_mapping", "is_windowed", "select_attention_backend",
           "token_positions"]
