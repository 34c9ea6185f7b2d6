"""Choosing a runner's attention backend, once."""
from __future__ import annotations

import torch

from kvserve.native import cpu_kernels
from kvserve.model.attention.backend import AttentionBackend
from kvserve.model.attention.cpu_native_backend import CpuNativeAttentionBackend
from kvserve.model.attention.torch_backend import TorchAttentionBackend


def select_attention_backend(device: torch.device | str, kv_dtype: torch.dtype, num_heads: int,
                             num_kv_heads: int, head_dim: int, native_kernels: bool,
                             isa: str | None = None, prefill_kernel: bool = True) -> AttentionBackend:
    """The native CPU backend where it applies (CPU, a float32/bfloat16/float16 KV cache, a head
    shape the kernel takes, `native_kernels` allowed, which also means float32/bfloat16
    activations, and the library built), else the torch backend. `isa`: the kernel's path
    (None: the widest this CPU runs); `prefill_kernel`: its prompt chunks take the tiled prefill kernel."""
    if (native_kernels and torch.device(device).type == "cpu" and cpu_kernels.supports_kv_dtype(kv_dtype)
            and cpu_kernels.supports_shape(num_heads, num_kv_heads, head_dim)
            and cpu_kernels.load_library() is not None):
        return CpuNativeAttentionBackend(isa, prefill_kernel)
    return TorchAttentionBackend()
