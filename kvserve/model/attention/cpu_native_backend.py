"""The native CPU attention backend: the C kernel (csrc/attention/paged_attention.c via
`cpu_kernels`) attends the short queries (decode, small chunks) reading K/V in
place from the cache and writes this step's K/V; longer prompt chunks, where a
padded matmul reuses each key across many queries, and ring-buffer groups
(which read before they write) take the torch path of the same plan.
"""
from __future__ import annotations

import torch

from kvserve.native import cpu_kernels
from kvserve.model.attention.backend import AttentionParams
from kvserve.model.attention.metadata import AttentionMetadata, AttentionPlan
from kvserve.model.attention.torch_backend import TorchAttentionBackend, attend_with_torch, store_with_index_copy


class CpuNativeAttentionBackend(TorchAttentionBackend):
    """CPU, float32/bfloat16 activations over a float32/bfloat16/float16 KV cache, a head shape
    the kernel takes (see `cpu_kernels.supports_shape`); the selector checks that once per runner.
    `isa`: the kernel's path ("avx512", "avx2", "portable"; None: the widest this CPU runs)."""

    name = "cpu_native"
    plans_native_queries = True

    def __init__(self, isa: str | None = None) -> None:
        self.isa = isa or cpu_kernels.widest_attention_isa()

    def plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, params: AttentionParams) -> AttentionPlan:
        # A cache the kernel cannot read in place (a non-contiguous view in a test) takes the torch path.
        native = kv_cache.is_contiguous() and params.sinks is None  # the kernel has no sinks
        return metadata.plan(kv_cache.shape[3], params.sliding_window, native)

    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
        if (k.stride() == v.stride() and k.stride(-1) == 1 and kv_cache.is_contiguous()
                and plan.write_slots.dtype == torch.int64 and plan.write_slots.is_contiguous()):
            cpu_kernels.store_kv(k, v, kv_cache, plan.write_slots, plan.write_token_index)
        else:
            store_with_index_copy(kv_cache, k, v, plan)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               plan: AttentionPlan, params: AttentionParams) -> torch.Tensor:
        out = None
        if plan.native is not None:
            out = q.new_empty(q.shape)
            tokens = plan.native
            cpu_kernels.paged_attention_cpu(q, kv_cache, out, tokens.token_index, tokens.positions,
                                            tokens.block_table, tokens.table_row, tokens.window, params.scale,
                                            params.softcap, self.isa)
        return attend_with_torch(q, k, v, kv_cache, plan, params, out)
