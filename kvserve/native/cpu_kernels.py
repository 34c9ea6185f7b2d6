"""The Python face of the native CPU kernels (built and loaded by `kvserve.native.build`,
declared in `kvserve.native.abi`): paged attention (csrc/attention/paged_attention.c),
the decoder's fused element-wise ops (csrc/decoder/fused_ops.c: residual add + RMSNorm,
SiLU-gated product, RoPE), the small-batch matmul (csrc/linear/small_linear.c) and the
float32 matmul over weights packed into panels at load (csrc/linear/f32_gemm.c). The
matmuls over block-quantized weights (csrc/linear/quant_*.c) are driven by
kvserve/model/quantized.py, the whole decoder stack of a small step in one call
(csrc/decoder/fused_decoder.c) by kvserve/model/native_decoder.py, the grammar's token
bitmask (csrc/grammar/grammar_mask.c) by kvserve/sample/structured/grammar_mask.py, and the
tensor-parallel ranks' all-reduce through shared memory (csrc/comm/shm_all_reduce.c) by
kvserve/model/shm_all_reduce.py.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import numpy as np
import torch

from kvserve.native import abi, dispatch
from kvserve.native import isa as isa_table
from kvserve.native.build import load_library

logger = logging.getLogger(__name__)

_DTYPE_CODES, _KV_DTYPE_CODES = abi.DTYPE_CODES, abi.KV_DTYPE_CODES
# Paths of the paged attention kernel (csrc/attention/paged_attention.c): every kernel's codes.
ATTENTION_ISA_CODES = isa_table.ISA_CODES


class KernelArgumentError(ValueError):
    """The native kernel rejected its arguments (a shape it does not handle)."""


def supports_dtype(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


def supports_kv_dtype(dtype: torch.dtype) -> bool:
    """Whether the attention kernel and the K/V write take a cache of `dtype`."""
    return dtype in _KV_DTYPE_CODES


def kv_dtype_code(dtype: torch.dtype) -> int:
    """The kernels' code of a KV-cache dtype (`supports_kv_dtype`)."""
    return _KV_DTYPE_CODES[dtype]


# Limits of the kernels' on-stack buffers (MAX_HEAD_DIM, MAX_GROUP in paged_attention.c,
# the row buffer of kvserve_rms_norm in fused_ops.c).
_MAX_HEAD_DIM, _MAX_GROUP, _MAX_NORM_DIM = 256, 32, 8192


def supports_shape(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (head_dim <= _MAX_HEAD_DIM and num_kv_heads > 0 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= _MAX_GROUP)


def attention_isa_available(isa: str) -> bool:
    """Whether the attention kernel's path `isa` runs here (this build, this CPU)."""
    return dispatch.available("attention", isa)


def widest_attention_isa() -> str:
    """The widest path of the attention kernel that runs here ("portable" without the library)."""
    return dispatch.widest("attention") or "portable"


def takes(*tensors: torch.Tensor) -> bool:
    """The element-wise kernels can read these tensors as they are: float32 or bfloat16 with
    contiguous rows. (Device and library are settled once per runner, see `kvserve.model.kernels`.)"""
    return all(t.dtype in _DTYPE_CODES and t.stride(-1) == 1 for t in tensors)


def _threads() -> int:
    return torch.get_num_threads()


def paged_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, token_index: torch.Tensor,
                        positions: torch.Tensor, block_table: torch.Tensor, table_row: torch.Tensor,
                        window: int | None, scale: float, softcap: float | None, isa: str | None = None,
                        sinks: torch.Tensor | None = None) -> None:
    """Writes attention for the tokens `token_index` (rows of q [T, Hq, D]) into the same rows of `out`.

    Token t sits at `positions[t]` of the request whose block ids are row
    `table_row[t]` of `block_table` (int64); it attends to keys
    max(0, pos - window + 1)..pos, all of which must already be in `kv_cache`
    [2, Hkv, blocks, block_size, D] (float32, bfloat16 or float16). Index tensors are
    int64 and contiguous. `isa`: the kernel's path (None: the widest `attention_isa_available`).
    `sinks`: float32 [Hq], contiguous: a logit per query head joining its softmax (gpt-oss)."""
    num_tokens = token_index.numel()
    if num_tokens == 0:
        return
    lib, num_kv_heads, head_stride, block_size, head_dim = _attention_layout(q, kv_cache, out)
    _check_sinks(sinks, q.shape[1])
    code = lib.kvserve_paged_attention(q.data_ptr(), q.stride(0), q.stride(1),
              kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), head_stride,
              out.data_ptr(), out.stride(0), out.stride(1),
              token_index.data_ptr(), positions.data_ptr(), block_table.data_ptr(), block_table.stride(0),
              table_row.data_ptr(), num_tokens, q.shape[1], num_kv_heads, head_dim, block_size,
              window or 0, scale, softcap or 0.0, None if sinks is None else sinks.data_ptr(),
              _DTYPE_CODES[q.dtype], _KV_DTYPE_CODES[kv_cache.dtype],
              ATTENTION_ISA_CODES[isa or widest_attention_isa()], _threads())
    _check_attention_code(code, "attention", isa, q.shape[1], num_kv_heads, head_dim)


def _attention_layout(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> tuple:
    """(library, KV heads, elements between KV heads, block size, head size) for an attention
    kernel's call, after checking the layout it reads."""
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or not kv_cache.is_contiguous():
        raise KernelArgumentError("q/out rows and the KV cache must be contiguous in the head dimension")
    return lib, num_kv_heads, num_blocks * block_size * head_dim, block_size, head_dim


def _check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                              or sinks.shape != (num_heads,)):
        raise KernelArgumentError(f"sinks must be float32 [{num_heads}], contiguous")


def _check_attention_code(code: int, kernel: str, isa: str | None, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> None:
    """Raises for an attention kernel's nonzero return code (1: arguments, 2: memory, 3: path)."""
    if code == 3:
        raise KernelArgumentError(f"the {isa} path of the CPU {kernel} kernel does not run on this CPU")
    if code == 2:
        raise MemoryError(f"the CPU {kernel} kernel could not allocate its buffers")
    if code:
        raise KernelArgumentError(f"CPU {kernel} kernel rejected its arguments (code {code}): "
                                  f"{num_heads} heads, {num_kv_heads} KV heads, head size {head_dim}")


def prefill_attention_cpu(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, chunk_start: torch.Tensor,
                          chunk_len: torch.Tensor, chunk_pos: torch.Tensor, chunk_row: torch.Tensor,
                          block_table: torch.Tensor, window: int | None, scale: float, softcap: float | None,
                          isa: str | None = None, sinks: torch.Tensor | None = None) -> None:
    """Writes the causal attention of prompt chunks (csrc/attention/prefill_attention.c) into `out`.

    Chunk c is the `chunk_len[c]` tokens at rows chunk_start[c].. of q [T, Hq, D] (and of
    `out`), at positions chunk_pos[c].. of the request whose block ids are row `chunk_row[c]`
    of `block_table`; each token attends to keys max(0, pos - window + 1)..pos, all already in
    `kv_cache` [2, Hkv, blocks, block_size, D]. Index tensors are int64 and contiguous. `isa`:
    the kernel's path (None: the widest `attention_isa_available`; "avx2" runs the portable code).
    `sinks`: float32 [Hq], contiguous: a logit per query head joining its softmax (gpt-oss)."""
    num_chunks = chunk_start.numel()
    if num_chunks == 0:
        return
    lib, num_kv_heads, head_stride, block_size, head_dim = _attention_layout(q, kv_cache, out)
    _check_sinks(sinks, q.shape[1])
    code = lib.kvserve_prefill_attention(
        q.data_ptr(), q.stride(0), q.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), head_stride,
        out.data_ptr(), out.stride(0), out.stride(1), chunk_start.data_ptr(), chunk_len.data_ptr(),
        chunk_pos.data_ptr(), chunk_row.data_ptr(), block_table.data_ptr(), block_table.stride(0), num_chunks,
        q.shape[1], num_kv_heads, head_dim, block_size, window or 0, scale, softcap or 0.0,
        None if sinks is None else sinks.data_ptr(), _DTYPE_CODES[q.dtype], _KV_DTYPE_CODES[kv_cache.dtype],
        ATTENTION_ISA_CODES[isa or widest_attention_isa()], _threads())
    _check_attention_code(code, "prefill attention", isa, q.shape[1], num_kv_heads, head_dim)


HUGE_PAGE_BYTES = _HUGE_PAGE = 2 << 20
_SMALL_PAGE = 4096
_MADV_HUGEPAGE = 14
_MADV_NOHUGEPAGE = 15


def zeros_on_huge_pages(nbytes: int, advise: bool = True) -> torch.Tensor:
    """A zeroed CPU byte buffer, 2 MiB-aligned on Linux, whose aligned part is backed by
    transparent huge pages where the kernel allows (THP in "madvise" or "always" mode) when
    `advise`; else on ordinary pages until `advise_huge_pages` moves ranges of it.

    The paged attention kernel reads KV blocks scattered over a large buffer: on
    4 KiB pages nearly every block costs a TLB miss (about 15% of its time).
    Elsewhere this is a plain `torch.zeros`. The zeros are an anonymous private
    mapping of their own, so the OS supplies zeroed pages on first touch: pages never
    used take no memory. (A calloc may hand back freed heap memory that is already
    resident and must clear it: after loading a model that freed large buffers, a
    2 GiB pool became resident at once.) A huge page is faulted in whole (2 MiB) on
    its first byte, so a KV pool is advised only as its used part grows
    (`kvserve.worker.kv_tensors.KVHugePageGrowth`); `advise=False` says so to the OS
    (where THP is "always", the mapping would otherwise take huge pages)."""
    if nbytes < 4 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))  # the array keeps the mapping alive
    start = (-raw.data_ptr()) % _HUGE_PAGE
    buffer = raw[start:start + nbytes]
    _madvise(buffer.data_ptr(), nbytes - nbytes % _HUGE_PAGE, _MADV_HUGEPAGE if advise else _MADV_NOHUGEPAGE)
    return buffer


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) over [address, address + nbytes), shrunk to whole 4 KiB pages;
    False where the OS refused or has no such advice (the range keeps ordinary pages)."""
    return _madvise(address, nbytes, _MADV_HUGEPAGE)


def _madvise(address: int, nbytes: int, advice: int) -> bool:
    start = -(-address // _SMALL_PAGE) * _SMALL_PAGE
    end = (address + nbytes) // _SMALL_PAGE * _SMALL_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0
    except (OSError, AttributeError):
        return False


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
                                    num_kv_heads, head_dim, _DTYPE_CODES[k.dtype], _KV_DTYPE_CODES[kv_cache.dtype])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, adds_one: bool,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [..., dim] (or of x + residual, stored into residual in place); `weight`
    is float32. Callers check `takes` and that the rows are contiguous. `out`: a contiguous
    tensor of x's shape and dtype (apart from x and residual) to write the result into."""
    dim = x.shape[-1]
    if dim > _MAX_NORM_DIM:
        raise KernelArgumentError(f"RMSNorm over {dim} > {_MAX_NORM_DIM} elements")
    x = x.contiguous()
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise KernelArgumentError("rms_norm's out must be contiguous, of x's shape and dtype")
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


def silu_mul_parts(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate and up [rows, width] (contiguous, one dtype) -> `out` [rows, width]
    (allocated when None; it may be `gate` itself: the kernel reads each element before it
    writes it), as `silu_mul` computes it."""
    if gate.shape != up.shape or gate.dtype != up.dtype or not (gate.is_contiguous() and up.is_contiguous()):
        raise KernelArgumentError("silu_mul_parts needs gate and up of one shape and dtype, contiguous")
    rows, width = gate.shape
    out = gate.new_empty(rows, width) if out is None else out
    load_library().kvserve_silu_mul_parts(gate.data_ptr(), up.data_ptr(), out.data_ptr(), rows, width,
                                          _DTYPE_CODES[gate.dtype], _threads())
    return out


def swiglu_clamped(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's (clamp(up) + 1) * (g * sigmoid(alpha g)), g = min(gate, limit), for gate_up
    [rows, 2 * width] (contiguous) -> [rows, width]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    load_library().kvserve_swiglu_clamped(gate_up.data_ptr(), out.data_ptr(), rows, width, limit, alpha,
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


# Output rows per panel of csrc/linear/f32_gemm.c (PANEL).
F32_PANEL = 16


def pack_f32_panels(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [out, in] (rows contiguous) in the panel layout of csrc/linear/f32_gemm.c:
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


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, read_slot: torch.Tensor, write_slot: torch.Tensor,
                     isa: str | None = None) -> torch.Tensor:
    """One gated-delta-rule token per request (csrc/ssm/gated_delta_step.c): q, k [B, Hk, Dk] (k
    L2-normalized, q also scaled), v [B, Hv, Dv], g (log decay) and beta [B, Hv], all float32
    with contiguous rows; the cache's states [slots, Hv, Dk, Dv] (float32, contiguous) read from
    `read_slot` (-1: zeros) and written to `write_slot` ([B] int64). Returns the outputs
    [B, Hv, Dv]. `isa`: the path (None: the widest that runs here)."""
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    batch, num_k_heads, dk = k.shape
    _, num_v_heads, _, dv = states.shape
    rows = [t.reshape(batch, -1) for t in (q, k, v, g, beta)]
    if any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in rows) or not states.is_contiguous() \
            or states.dtype != torch.float32 or tuple(states.shape[2:]) != (dk, dv) or q.shape != k.shape \
            or tuple(v.shape[1:]) != (num_v_heads, dv) or rows[0].stride(0) != rows[1].stride(0) \
            or rows[3].stride(0) != rows[4].stride(0) or g.shape != (batch, num_v_heads):
        raise KernelArgumentError("gated_delta_step needs float32 rows of matching shapes and contiguous states")
    read_slot, write_slot = read_slot.long().contiguous(), write_slot.long().contiguous()
    out = v.new_empty(batch, num_v_heads, dv)
    scratch = v.new_empty(dv)
    q_rows, k_rows, v_rows, g_rows, beta_rows = rows
    code = lib.kvserve_gated_delta_step(
        q_rows.data_ptr(), k_rows.data_ptr(), k_rows.stride(0), v_rows.data_ptr(), v_rows.stride(0),
        g_rows.data_ptr(), beta_rows.data_ptr(), g_rows.stride(0), states.data_ptr(), read_slot.data_ptr(),
        write_slot.data_ptr(), batch, num_k_heads, num_v_heads, dk, dv, scratch.data_ptr(), out.data_ptr(),
        num_v_heads * dv, isa_table.ISA_CODES[isa or dispatch.widest("gated_delta")])
    if code == 3:
        raise KernelArgumentError(f"the {isa} path of the gated delta step kernel does not run on this CPU")
    if code:
        raise KernelArgumentError(f"the gated delta step kernel rejected its arguments (code {code})")
    return out


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def mamba2_decode_step(xbc: torch.Tensor, dt_raw: torch.Tensor, conv_states: torch.Tensor,
                       ssm_states: torch.Tensor, read_slot: torch.Tensor, write_slot: torch.Tensor,
                       conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                       A: torch.Tensor, D: torch.Tensor, dt_range: tuple[float, float], n_groups: int,
                       isa: str | None = None) -> torch.Tensor:
    """One Mamba-2 token per request (csrc/ssm/mamba2_step.c): xbc [B, conv_dim] and dt_raw [B, H]
    float32 with contiguous rows; the cache's conv states [slots, K-1, conv_dim] and SSM states
    [slots, H, P, N] (float32, contiguous) read from `read_slot` (-1: zeros) and written to
    `write_slot` ([B] int64). The parameters float32 and contiguous: conv weight [conv_dim, K],
    conv bias, dt bias, A = -exp(A_log), D. Returns y [B, H*P] before the gated norm. `isa`: the
    path (None: the widest that runs here)."""
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available")
    batch, channels = xbc.shape
    _, num_heads, head_dim, n_state = ssm_states.shape
    kernel = conv_weight.shape[1]
    tensors = [xbc, dt_raw, conv_weight, dt_bias, A, D] + ([conv_bias] if conv_bias is not None else [])
    if any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in tensors) or \
            not (conv_states.is_contiguous() and ssm_states.is_contiguous() and conv_weight.is_contiguous()) or \
            conv_states.dtype != torch.float32 or ssm_states.dtype != torch.float32 or \
            tuple(conv_states.shape[1:]) != (kernel - 1, channels) or \
            channels != num_heads * head_dim + 2 * n_groups * n_state:
        raise KernelArgumentError("mamba2_decode_step needs float32 contiguous rows and matching state shapes")
    read_slot, write_slot = read_slot.long().contiguous(), write_slot.long().contiguous()
    y = xbc.new_empty(batch, num_heads * head_dim)
    scratch = xbc.new_empty(batch, channels)
    dt_min, dt_max = (max(-_FLOAT32_MAX, min(v, _FLOAT32_MAX)) for v in dt_range)  # no infinities (fast-math C)
    code = lib.kvserve_mamba2_decode_step(
        xbc.data_ptr(), xbc.stride(0), dt_raw.data_ptr(), dt_raw.stride(0), conv_states.data_ptr(),
        ssm_states.data_ptr(), read_slot.data_ptr(), write_slot.data_ptr(), conv_weight.data_ptr(),
        None if conv_bias is None else conv_bias.data_ptr(), dt_bias.data_ptr(), A.data_ptr(), D.data_ptr(),
        dt_min, dt_max, batch, num_heads, head_dim, n_state, n_groups, kernel, scratch.data_ptr(), y.data_ptr(),
        y.stride(0), isa_table.ISA_CODES[isa or dispatch.widest("mamba2")], _threads())
    if code == 3:
        raise KernelArgumentError(f"the {isa} path of the Mamba-2 step kernel does not run on this CPU")
    if code:
        raise KernelArgumentError(f"the Mamba-2 step kernel rejected its arguments (code {code})")
    return y
