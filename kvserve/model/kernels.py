"""The kernels one model uses, chosen once per runner from the `KernelConfig`
(the environment switches read at start-up), the device and the dtype.

Every layer reads its choice from here instead of asking, op by op, whether a
native kernel could take its tensors: the attention backend, whether the fused
element-wise kernels (RMSNorm, RoPE, SiLU-gated product) run, whether packed
linear weights keep a plain copy for the small-batch matmul, and the paths of
the quantized, bfloat16 and float32 panel matmuls. Per-call checks that remain
are on tensor layout only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.native.config import KernelConfig
from kvserve.native import cpu_kernels
from kvserve.model import native_decoder
from kvserve.model.attention import AttentionBackend, TorchAttentionBackend, select_attention_backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionShape:
    """One rank's attention layout: query heads, KV heads, head size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelKernels:
    """What a model runs with (see the module docstring); `torch_only()` is the portable choice."""

    attention: AttentionBackend
    native_ops: bool = False  # fused RMSNorm / RoPE / SiLU-mul kernels
    small_batch_matmul: bool = False  # packed weights keep a plain copy for the small-batch kernel
    packed_weights: bool = False  # linear weights packed for oneDNN's CPU matmul
    native_decoder: bool = False  # small steps run the whole stack in one call (model/native_decoder.py)
    bf16_isa: str | None = None  # the native decoder's bfloat16-weight matmul path (None: bfloat16 declined)
    # float32 weights packed into panels for csrc/linear/f32_gemm.c (instead of oneDNN), and its path
    f32_gemm_isa: str | None = None
    attention_isa: str | None = None  # the paged attention kernel's path (None: no kernel)
    # tensor-parallel ranks of one host: the native decoder all-reduces through shared memory
    shm_all_reduce: bool = False

    @classmethod
    def torch_only(cls) -> "ModelKernels":
        return cls(attention=TorchAttentionBackend())

    def describe(self) -> str:
        return (f"attention {self.attention.name}, fused ops {'native' if self.native_ops else 'torch'}, "
                f"packed weights {'on' if self.packed_weights else 'off'}, "
                f"small-batch matmul {'on' if self.small_batch_matmul else 'off'}, "
                f"native decoder {'on' if self.native_decoder else 'off'}"
                + (f" (bfloat16 weights: {self.bf16_isa})" if self.bf16_isa else "")
                + (f", float32 panel matmul {self.f32_gemm_isa}" if self.f32_gemm_isa else "")
                + (f", attention kernel {self.attention_isa}" if self.attention_isa else ""))


def choose_model_kernels(kernel_config: KernelConfig, device: torch.device | str, dtype: torch.dtype,
                         shape: AttentionShape, kv_dtype: torch.dtype | None = None) -> ModelKernels:
    """The kernels for a model of `dtype` on `device` whose KV cache holds `kv_dtype` (None: `dtype`)."""
    on_cpu = torch.device(device).type == "cpu"
    native = (kernel_config.cpu_kernels and on_cpu and cpu_kernels.supports_dtype(dtype)
              and cpu_kernels.load_library() is not None)
    attention_isa = native_decoder.attention_isa(kernel_config) if native else None
    attention = select_attention_backend(device, kv_dtype or dtype, shape.num_heads, shape.num_kv_heads,
                                         shape.head_dim, native_kernels=native, isa=attention_isa,
                                         prefill_kernel=kernel_config.prefill_attention)
    bf16 = native_decoder.bf16_isa(kernel_config) if native and dtype == torch.bfloat16 else None
    f32 = native_decoder.f32_gemm_isa(kernel_config) if native and dtype == torch.float32 \
        and kernel_config.packed_weights else None
    kernels = ModelKernels(
        attention=attention, native_ops=native,
        small_batch_matmul=native and kernel_config.small_batch_matmul and cpu_kernels.small_linear_supported(dtype),
        packed_weights=on_cpu and kernel_config.packed_weights,
        native_decoder=native and kernel_config.native_decoder and (dtype == torch.float32 or bf16 is not None),
        bf16_isa=bf16, f32_gemm_isa=f32, attention_isa=attention_isa if attention.name == "cpu_native" else None,
        shm_all_reduce=native and kernel_config.shm_all_reduce)
    _log_once(kernels.describe())
    return kernels


_logged: set[str] = set()


def _log_once(description: str) -> None:
    """The chosen kernels at INFO the first time a process chooses them (TP ranks and
    draft models that choose the same do not repeat it), at DEBUG after that."""
    level = logging.DEBUG if description in _logged else logging.INFO
    _logged.add(description)
    logger.log(level, "model kernels: %s", description)
