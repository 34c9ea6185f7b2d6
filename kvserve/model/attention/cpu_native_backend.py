"""The native CPU attention backend: the C kernels attend reading K/V in place from the
cache, after writing this step's K/V there: the short queries (decode, small chunks, speculative
verify steps) token by token (csrc/attention/paged_attention.c, the float order plain decoding
uses), the longer prompt chunks in tiles of queries against tiles of keys
(csrc/attention/prefill_attention.c; `prefill_kernel=False`, KVSERVE_PREFILL_ATTENTION=0: the
torch path's padded matmuls and SDPA instead). Ring-buffer groups (which read before they write)
take the torch path of the same plan.
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
    `isa`: the kernels' path ("avx512", "avx2", "portable"; None: the widest this CPU runs);
    `prefill_kernel`: prompt chunks of more than a few tokens take the tiled prefill kernel."""

    name = "cpu_native"
    plans_native_queries = True

    def __init__(self, isa: str | None = None, prefill_kernel: bool = True) -> None:
        self.isa = isa or cpu_kernels.widest_attention_isa()
        self.prefill_kernel = prefill_kernel

    def plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, params: AttentionParams) -> AttentionPlan:
        # A cache the kernel cannot read in place (a non-contiguous view in a test) takes the torch path.
        native = kv_cache.is_contiguous()
        prefill = native and self.prefill_kernel
        return metadata.plan(kv_cache.shape[3], params.sliding_window, native, prefill)

    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
        if (k.stride() == v.stride() and k.stride(-1) == 1 and kv_cache.is_contiguous()
                and plan.write_slots.dtype == torch.int64 and plan.write_slots.is_contiguous()):
            cpu_kernels.store_kv(k, v, kv_cache, plan.write_slots, plan.write_token_index)
        else:
            store_with_index_copy(kv_cache, k, v, plan)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               plan: AttentionPlan, params: AttentionParams) -> torch.Tensor:
        out = None
        if plan.native is not None or plan.prefill is not None:
            out = q.new_empty(q.shape)
        sinks = None if params.sinks is None else params.sinks.detach().float().contiguous()
        if plan.native is not None:
            tokens = plan.native
            cpu_kernels.paged_attention_cpu(q, kv_cache, out, tokens.token_index, tokens.positions,
                                            tokens.block_table, tokens.table_row, tokens.window, params.scale,
                                            params.softcap, self.isa, sinks=sinks)
        if plan.prefill is not None:
            chunks = plan.prefill
            cpu_kernels.prefill_attention_cpu(q, kv_cache, out, chunks.start, chunks.length, chunks.first_pos,
                                              chunks.table_row, chunks.block_table, chunks.window, params.scale,
                                              params.softcap, self.isa, sinks=sinks)
        return attend_with_torch(q, k, v, kv_cache, plan, params, out)
