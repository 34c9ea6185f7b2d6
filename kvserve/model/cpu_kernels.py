"""Native CPU kernels, compiled at first use with the system C compiler and
loaded with ctypes (no torch headers, so a build takes about a second):
paged attention (csrc/paged_attention.c), the decoder's fused element-wise
ops (csrc/fused_ops.c: residual add + RMSNorm, SiLU-gated product, RoPE),
the small-batch matmul (csrc/small_linear.c), the float32 matmul over weights
packed into panels at load (csrc/f32_gemm.c), the matmuls over block-quantized
weights (csrc/quant_linear.c, csrc/quant_gemm.c for steps of many rows, driven
by kvserve/model/quantized.py) and the whole decoder stack of a small step in
one call (csrc/fused_decoder.c, driven by kvserve/model/native_decoder.py), and a
grammar's token bitmask applied to the logits (csrc/grammar_mask.c, driven by
kvserve/model/grammar_mask.py), and the tensor-parallel ranks' all-reduce
through shared memory (csrc/shm_all_reduce.c, kvserve/model/shm_all_reduce.py).

The shared object is cached under `<cache root>/kernels/<key>/`, keyed by the
source, the compiler flags, the compiler's version and the CPU's feature flags
(`-march=native` code must not run on another CPU). Without a compiler
`load_library()` returns None and callers keep the portable torch path.
Whether a model uses these kernels at all is decided once per runner
(`kvserve.model.kernels`, from `KernelConfig`: KVSERVE_CPU_KERNELS=0 turns
them off and nothing is built); this module reads no environment switch.

The kernel is linked with `-fopenmp`: the library it needs (libgomp.so.1) is
the one torch already loaded, so both share one thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources

import numpy as np
import torch

from kvserve.config import cache_root

logger = logging.getLogger(__name__)

_SOURCES = ("bf16.h", "bf16_tile.h", "paged_attention.c", "fused_ops.c", "small_linear.c", "quant_linear.c", "quant_gemv.c",
            "quant_gemm.c", "bf16_rows.c", "f32_gemm.c", "phase_timer.h", "fused_decoder.c", "grammar_mask.c",
            "shm_all_reduce.c")
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class KernelArgumentError(ValueError):
    """The native kernel rejected its arguments (a shape it does not handle)."""


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


# Limits of the kernels' on-stack buffers (MAX_HEAD_DIM, MAX_GROUP in paged_attention.c,
# the row buffer of kvserve_rms_norm in fused_ops.c).
_MAX_HEAD_DIM, _MAX_GROUP, _MAX_NORM_DIM = 256, 32, 8192


def supports_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (head_dim <= _MAX_HEAD_DIM and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= _MAX_GROUP)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(compiler: str, sources: dict[str, str], target_dir: str) -> str:
    target = os.path.join(target_dir, "kvserve_cpu.so")
    if os.path.exists(target):
        return target
    os.makedirs(target_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        paths = []
        for name, text in sources.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
            if name.endswith(".c"):
                paths.append(os.path.join(tmp, name))
        tmp_target = os.path.join(tmp, "out.so")
        subprocess.run([compiler, *_CFLAGS, *paths, "-o", tmp_target, "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp_target, target)  # atomic: concurrent builders (TP ranks) agree
    return target


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "kvserve_paged_attention": ([ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr,
                                     i64, i64, i64, i64, i64, i64, f32, f32, c_int, c_int, c_int], c_int),
        "kvserve_store_kv": ([ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, c_int, c_int], None),
        "kvserve_rms_norm": ([ptr, ptr, ptr, ptr, i64, i64, i64, f32, c_int, c_int, c_int], None),
        "kvserve_silu_mul": ([ptr, ptr, i64, i64, c_int, c_int], None),
        "kvserve_rotary": ([ptr, i64, i64, ptr, ptr, i64, i64, i64, c_int, c_int], None),
        "kvserve_small_linear_supported": ([c_int], c_int),
        "kvserve_small_linear": ([ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, c_int, c_int], c_int),
        "kvserve_quant_isa_available": ([c_int], c_int),
        "kvserve_quant_linear": ([ptr, i64, i64, ptr, ptr, ptr, c_int, i64, i64, ptr, ptr, i64, c_int, c_int,
                                  c_int, c_int], c_int),
        "kvserve_quant_dequantize": ([ptr, ptr, ptr, c_int, i64, i64, ptr, c_int, c_int], c_int),
        "kvserve_quant_embed": ([ptr, ptr, ptr, c_int, i64, i64, ptr, i64, ptr], c_int),
        "kvserve_decoder_forward": ([ptr, ptr, ptr, ptr, c_int], c_int),
        "kvserve_decoder_forward_logits": ([ptr, ptr, ptr, ptr, ptr, c_int], c_int),
        "kvserve_decoder_profile_enable": ([c_int], None),
        "kvserve_decoder_profile_read": ([ptr, c_int], i64),
        "kvserve_quant_activations": ([ptr, i64, i64, i64, c_int, ptr, ptr], None),
        "kvserve_quant_gemm_isa_available": ([c_int], c_int),
        "kvserve_quant_gemm": ([ptr, i64, i64, ptr, ptr, ptr, c_int, i64, i64, ptr, ptr, i64, c_int, c_int, c_int],
                               c_int),
        "kvserve_bf16_isa_available": ([c_int], c_int),
        "kvserve_f32_gemm_isa_available": ([c_int], c_int),
        "kvserve_f32_packed_size": ([i64, i64], i64),
        "kvserve_f32_pack": ([ptr, i64, i64, i64, ptr], None),
        "kvserve_f32_gemm": ([ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, c_int, c_int], c_int),
        "kvserve_bf16_round_rows": ([ptr, i64, i64, i64, ptr], None),
        "kvserve_bf16_linear_rows": ([ptr, i64, ptr, ptr, i64, ptr, i64, c_int, i64, i64], None),
        "kvserve_mask_isa_available": ([c_int], c_int),
        "kvserve_apply_token_bitmask": ([ptr, i64, i64, ptr, i64, i64, ptr, i64, c_int], c_int),
        "kvserve_publish_mask_ready": ([ptr, ctypes.c_int32], None),
        "kvserve_mask_token_range": ([ptr, ptr, i64, i64, i64, c_int], None),
        "kvserve_shm_all_reduce": ([ptr, ptr, i64], ctypes.c_int32),
        "kvserve_quant_rows": ([ptr, ptr, i64, ptr, ptr, ptr, c_int, i64, ptr, ptr, i64, c_int, c_int, i64, i64],
                               None),
        "kvserve_gemv_partials": ([ptr, ptr, ptr, ptr, ptr, ptr, c_int, i64, ptr, i64, ptr, i64, i64, i64], c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def _load() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU attention and norms use the slower torch path")
        return None
    package = resources.files("kvserve.model").joinpath("csrc")
    sources = {name: package.joinpath(name).read_text() for name in _SOURCES}
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*sources.values(), " ".join(_CFLAGS), version, _cpu_flags()]).encode())
    try:
        lib = ctypes.CDLL(_build(compiler, sources, os.path.join(cache_root(), "kernels", key.hexdigest()[:16])))
        _declare(lib)
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("building the CPU kernels failed, using the torch path: %s", detail.strip()[-500:])
        return None
    return lib


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, build failed); built once per process."""
    if "lib" in _loaded:  # the per-op fast path: no lock
        return _loaded["lib"]
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def takes(*tensors: torch.Tensor) -> bool:
    """The element-wise kernels can read these tensors as they are: float32 or bfloat16 with
    contiguous rows. (Device and library are settled once per runner, see `kvserve.model.kernels`.)"""
    return all(t.dtype in _DTYPE_CODES and t.stride(-1) == 1 for t in tensors)


def _threads() -> int:
    return torch.get_num_threads()


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, token_index: torch.Tensor,
                        positions: torch.Tensor, block_table: torch.Tensor, table_row: torch.Tensor,
                        window: int | None, scale: float, softcap: float | None) -> None:
    """Writes attention for the tokens `token_index` (rows of q [T, Hq, D]) into the same rows of `out`.

    Token t sits at `positions[t]` of the request whose block ids are row
    `table_row[t]` of `block_table` (int64); it attends to keys
    max(0, pos - window + 1)..pos, all of which must already be in `kv_cache`
    [2, Hkv, blocks, block_size, D]. Index tensors are int64 and contiguous."""
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    num_tokens = token_index.numel()
    if num_tokens == 0:
        return
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or not kv_cache.is_contiguous():
        raise KernelArgumentError("q/out rows and the KV cache must be contiguous in the head dimension")
    code = lib.kvserve_paged_attention(q.data_ptr(), q.stride(0), q.stride(1),
              kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), num_blocks * block_size * head_dim,
              out.data_ptr(), out.stride(0), out.stride(1),
              token_index.data_ptr(), positions.data_ptr(), block_table.data_ptr(), block_table.stride(0),
              table_row.data_ptr(), num_tokens, q.shape[1], num_kv_heads, head_dim, block_size,
              window or 0, scale, softcap or 0.0, _DTYPE_CODES[q.dtype], _DTYPE_CODES[kv_cache.dtype],
              _threads())
    if code:
        raise KernelArgumentError(f"CPU attention kernel rejected its arguments (code {code}): "
                                  f"{q.shape[1]} heads, {num_kv_heads} KV heads, head size {head_dim}")


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros_on_huge_pages(nbytes: int) -> torch.Tensor:
    """A zeroed CPU byte buffer whose 2 MiB-aligned part is backed by transparent huge
    pages where the kernel allows (Linux, THP in "madvise" or "always" mode).

    The paged attention kernel reads KV blocks scattered over a large buffer: on
    4 KiB pages nearly every block costs a TLB miss (about 15% of its time).
    Elsewhere this is a plain `torch.zeros`. The zeros come from calloc (numpy), so
    the OS supplies zeroed pages on first touch: blocks never used take no memory
    (`kvserve generate` stays small however large the pool)."""
    if nbytes < 4 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    raw = torch.from_numpy(np.zeros(nbytes + _HUGE_PAGE, dtype=np.uint8))  # calloc: no pages touched yet
    start = (-raw.data_ptr()) % _HUGE_PAGE
    buffer = raw[start:start + nbytes]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(nbytes - nbytes % _HUGE_PAGE),
                     _MADV_HUGEPAGE)  # advice only: a refusal leaves ordinary pages
    except (OSError, AttributeError):
        pass
    return buffer


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
             token_index: torch.Tensor | None) -> None:
    """Writes k/v [T, Hkv, D] (same strides, rows contiguous) into `kv_cache` [2, Hkv, blocks, block_size, D]
    at the int64 `slots` of the tokens `token_index` (None: all T, in order)."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    if k.stride() != v.stride() or k.stride(2) != 1 or not kv_cache.is_contiguous() or head_dim > _MAX_HEAD_DIM:
        raise KernelArgumentError("store_kv needs k/v with equal strides, contiguous rows and a contiguous cache")
    count = len(slots)
    load_library().kvserve_store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), kv_cache[0].data_ptr(),
                                    kv_cache[1].data_ptr(), num_blocks * block_size * head_dim, slots.data_ptr(),
                                    token_index.data_ptr() if token_index is not None else None, count,
                                    num_kv_heads, head_dim, _DTYPE_CODES[k.dtype], _DTYPE_CODES[kv_cache.dtype])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, adds_one: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., dim] (or of x + residual, stored into residual in place); `weight`
    is float32. Callers check `takes` and that the rows are contiguous."""
    dim = x.shape[-1]
    if dim > _MAX_NORM_DIM:
        raise KernelArgumentError(f"RMSNorm over {dim} > {_MAX_NORM_DIM} elements")
    x = x.contiguous()
    out = torch.empty_like(x)
    rows = x.numel() // dim
    load_library().kvserve_rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None,
                                    weight.data_ptr(), out.data_ptr(), rows, dim, dim, eps, int(adds_one),
                                    _DTYPE_CODES[x.dtype], _threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * width] (contiguous) -> [rows, width]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    load_library().kvserve_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width,
                                    _DTYPE_CODES[gate_up.dtype], _threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [tokens, heads, dim] in place (rows may be strided views); cos/sin [tokens, 1, dim] contiguous."""
    tokens, heads, dim = x.shape
    load_library().kvserve_rotary(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                  tokens, heads, dim, _DTYPE_CODES[x.dtype], _threads())
    return x


# Up to this many rows the small-batch kernel beats oneDNN's packed matmul (measured on
# AVX-512 Xeons: 1.2-1.8x at 1-4 rows, slower from 8 on).
SMALL_LINEAR_MAX_ROWS = 4


def small_linear_supported(dtype: torch.dtype) -> bool:
    """Whether the small-batch matmul kernel exists for `dtype` in this build (AVX-512 for
    float32, AVX512-BF16 for bfloat16)."""
    lib = load_library()
    return lib is not None and dtype in _DTYPE_CODES and bool(lib.kvserve_small_linear_supported(_DTYPE_CODES[dtype]))


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T (+ bias) for a few rows, weight in its plain contiguous
    layout; x rows contiguous, everything of one dtype. Callers check `small_linear_supported`."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features or x.stride(-1) != 1 or not weight.is_contiguous():
        raise KernelArgumentError("small_linear needs x rows and the weight contiguous with matching width")
    rows = x.shape[0]
    y = x.new_empty(rows, out_features)
    done = load_library().kvserve_small_linear(
        x.data_ptr(), x.stride(0), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
        out_features, in_features, y.data_ptr(), y.stride(0), rows, _DTYPE_CODES[x.dtype], _threads())
    if not done:
        raise KernelArgumentError(f"small_linear is not built for {x.dtype} on this CPU")
    return y


# Output rows per panel of csrc/f32_gemm.c (PANEL).
F32_PANEL = 16


def pack_f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [out, in] (rows contiguous) in the panel layout of csrc/f32_gemm.c:
    [ceil(out / 16), in, 16], the rows past `out` zeros."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.float32 or weight.stride(-1) != 1:
        raise KernelArgumentError("pack_f32_panels needs a float32 weight with contiguous rows")
    lib = load_library()
    packed = torch.empty(lib.kvserve_f32_packed_size(out_features, in_features), dtype=torch.float32)
    lib.kvserve_f32_pack(weight.data_ptr(), weight.stride(0), out_features, in_features, packed.data_ptr())
    return packed.view(-1, in_features, F32_PANEL)


def f32_gemm(x: torch.Tensor, panels: torch.Tensor, out_features: int, isa: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) -> [..., out_features] for W held as `pack_f32_panels` made it,
    on the kernel path `isa` (quant_linear.c's codes); x float32."""
    in_features = panels.shape[1]
    if x.dtype != torch.float32 or x.shape[-1] != in_features:
        raise KernelArgumentError(f"f32_gemm needs float32 rows of {in_features}, got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = x.new_empty(rows.shape[0], out_features)
    if bias is not None:
        bias = bias.float().contiguous()
    code = load_library().kvserve_f32_gemm(rows.data_ptr(), rows.stride(0), rows.shape[0], panels.data_ptr(),
                                           bias.data_ptr() if bias is not None else None, out_features, in_features,
                                           y.data_ptr(), out_features, isa, _threads())
    if code:
        raise KernelArgumentError(f"f32_gemm: kernel path {isa} is not available on this CPU")
    return y.view(*x.shape[:-1], out_features)
