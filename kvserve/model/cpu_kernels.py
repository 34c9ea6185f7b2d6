"""Native CPU kernels, compiled at first use with the system C compiler and
loaded with ctypes (no torch headers, so a build takes about a second).

The shared object is cached under `<cache root>/kernels/<key>/`, keyed by the
source, the compiler flags, the compiler's version and the CPU's feature flags
(`-march=native` code must not run on another CPU). Without a compiler, or
with KVSERVE_CPU_KERNELS=0, `load_paged_attention()` returns None and callers
keep the portable torch path.

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
import tempfile
import threading
from importlib import resources

import torch

from kvserve.config import cache_root

logger = logging.getLogger(__name__)

KERNELS_ENV = "KVSERVE_CPU_KERNELS"
_SOURCE = "paged_attention.c"
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_loaded: dict[str, object] = {}


class KernelArgumentError(ValueError):
    """The native kernel rejected its arguments (a shape it does not handle)."""


def kernels_enabled() -> bool:
    return os.environ.get(KERNELS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


# Limits of the kernel's on-stack buffers (MAX_HEAD_DIM, MAX_GROUP in the C source).
_MAX_HEAD_DIM, _MAX_GROUP = 256, 32


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


def _build(compiler: str, source: str, target_dir: str) -> str:
    target = os.path.join(target_dir, "paged_attention.so")
    if os.path.exists(target):
        return target
    os.makedirs(target_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        src_path = os.path.join(tmp, _SOURCE)
        with open(src_path, "w") as f:
            f.write(source)
        tmp_target = os.path.join(tmp, "out.so")
        subprocess.run([compiler, *_CFLAGS, src_path, "-o", tmp_target, "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp_target, target)  # atomic: concurrent builders (TP ranks) agree
    return target


def _load() -> object | None:
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU attention uses the slower torch path")
        return None
    source = resources.files("kvserve.model").joinpath("csrc", _SOURCE).read_text()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source, " ".join(_CFLAGS), version, _cpu_flags()]).encode()).hexdigest()[:16]
    try:
        path = _build(compiler, source, os.path.join(cache_root(), "kernels", key))
        lib = ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("building the CPU attention kernel failed, using the torch path: %s", detail.strip()[-500:])
        return None
    fn = lib.kvserve_paged_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr,
                   i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def load_paged_attention():
    """The compiled kernel's entry point, or None (disabled, no compiler, build failed). Built once per process."""
    if not kernels_enabled():
        return None
    with _lock:
        if "paged_attention" not in _loaded:
            _loaded["paged_attention"] = _load()
        return _loaded["paged_attention"]


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, token_index: torch.Tensor,
                        positions: torch.Tensor, block_table: torch.Tensor, table_row: torch.Tensor,
                        window: int | None, scale: float, softcap: float | None) -> None:
    """Writes attention for the tokens `token_index` (rows of q [T, Hq, D]) into the same rows of `out`.

    Token t sits at `positions[t]` of the request whose block ids are row
    `table_row[t]` of `block_table` (int64); it attends to keys
    max(0, pos - window + 1)..pos, all of which must already be in `kv_cache`
    [2, Hkv, blocks, block_size, D]. Index tensors are int64 and contiguous."""
    fn = load_paged_attention()
    if fn is None:
        raise RuntimeError("the CPU attention kernel is not available")
    num_tokens = token_index.numel()
    if num_tokens == 0:
        return
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or not kv_cache.is_contiguous():
        raise KernelArgumentError("q/out rows and the KV cache must be contiguous in the head dimension")
    code = fn(q.data_ptr(), q.stride(0), q.stride(1),
              kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), num_blocks * block_size * head_dim,
              out.data_ptr(), out.stride(0), out.stride(1),
              token_index.data_ptr(), positions.data_ptr(), block_table.data_ptr(), block_table.stride(0),
              table_row.data_ptr(), num_tokens, q.shape[1], num_kv_heads, head_dim, block_size,
              window or 0, scale, softcap or 0.0, _DTYPE_CODES[q.dtype], _DTYPE_CODES[kv_cache.dtype],
              torch.get_num_threads())
    if code:
        raise KernelArgumentError(f"CPU attention kernel rejected its arguments (code {code}): "
                                  f"{q.shape[1]} heads, {num_kv_heads} KV heads, head size {head_dim}")
