"""Block-quantized linear weights, computed as stored (GGUF Q4_0, Q4_1, Q8_0, Q4_K,
Q5_0, Q5_1, Q5_K, Q6_K).

At load the GGUF blocks are repacked into the one layout the native kernel
(csrc/linear/quant_linear.c) reads: per row, blocks of 32 columns, each holding 32
small integers q and float32 `d`, `m` that stand for d * q + m. Q4_0 (m = -8d),
Q4_1 and Q4_K (whose 6-bit sub-block scales are folded into d and m) become
4-bit weights, Q8_0 and the five-bit types (Q5_0, Q5_1, Q5_K) 8-bit ones, Q6_K
16-bit ones (quant times sub-block scale); all of them exactly (the repacked blocks
dequantize to the same floats as the file's). The weight is then held only in
this form: `QuantizedWeight.dequantize` rebuilds floats where needed (embedding
rows, tests).

The kernel path is picked once from the CPU's features: AVX512-VNNI, AVX2 or
portable C; `KernelConfig.quant_isa` (KVSERVE_QUANT_ISA=avx2|portable) caps it
at a narrower one (for tests and comparisons). The kernel rounds the activations
per block of 32 to int8 as llama.cpp does (`KernelConfig.quant_act_bits`, the default):
on AVX512-VNNI every row then takes the single-row kernel (quant_gemv.c), the default
model's perplexity +0.5% from float32 weights', near-tied greedy tokens flip (so do
llama.cpp's on the same file); KVSERVE_QUANT_ACT_BITS=16 rounds to int16, about as
exact as float32 inputs and slower.
Steps of many rows (prefill; `KernelConfig.quant_gemm_rows`,
320 by default) rebuild the weight densely instead (`dequantize_dense`, bfloat16 on
CPUs with native bfloat16) and run oneDNN's GEMM, several times faster there; steps
between (from `KernelConfig.quant_panel_rows`, 4 by default: batched decode, mixed
serving steps, short prefills) run the panel GEMM of csrc/linear/quant_gemm.c (`panel_linear`), which expands the
weight a cache-sized panel at a time. The loader stamps these choices on every weight it holds.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model import stored_weight
from kvserve.model.stored_weight import StoredWeight
from kvserve.native.config import QUANT_ISAS, KernelConfig
from kvserve.native import cpu_kernels, dispatch
from kvserve.native import isa as isa_table

logger = logging.getLogger(__name__)

ISA_CODES = isa_table.ISA_CODES  # the kernel's codes, narrowest first
BLOCK = 32
GROUP_COLS = 128  # columns of one 64-byte group of 4-bit blocks

# GGUF type name -> (bytes per super-block, columns per super-block)
_GGUF_LAYOUTS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32), "Q4_K": (144, 256),
                 "Q5_0": (22, 32), "Q5_1": (24, 32), "Q5_K": (176, 256), "Q6_K": (210, 256)}
SUPPORTED_GGUF_TYPES = tuple(_GGUF_LAYOUTS)


class QuantizationError(ValueError):
    """A tensor cannot be held quantized (type or shape the kernel does not take)."""


@dataclass
class QuantizedWeight:
    """One [out, in] weight in the kernel's layout: `qs` uint8 [out, in/2, in or 2 in],
    `d` and `m` float32 [out, in/32], `bits` 4, 8 or 16; `source_type` names the GGUF type.
    `act_bits` (8 or 16): how finely the kernel rounds the activations it multiplies;
    `isa`: the kernel path it runs on (None: the widest this CPU has). Steps of at least
    `gemm_rows` rows (0: never) dequantize it to `gemm_dtype` and run a dense GEMM; steps
    of `panel_rows` (0: never) to `gemm_rows` rows run the panel GEMM (`panel_linear`)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int
    in_features: int
    source_type: str
    act_bits: int = 16
    isa: str | None = None
    gemm_rows: int = 0
    gemm_dtype: torch.dtype = torch.float32
    panel_rows: int = 0

    def __post_init__(self) -> None:
        if self.bits == 16:  # the kernel pairs sixteen-bit weights with int16 activations only
            self.act_bits = 16

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def rows(self, index: torch.Tensor | slice) -> "QuantizedWeight":
        """The weight restricted to some rows (a tensor-parallel slice, a permutation)."""
        return dataclasses.replace(self, qs=self.qs[index].contiguous(), d=self.d[index].contiguous(),
                                   m=self.m[index].contiguous())

    def dequantize(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 values of all rows, or of the rows `index` (a 1-D int64 tensor): on the CPU
        one native call (an embedding lookup of a decode step costs microseconds, the torch
        ops below about ten dispatches), the same values either way."""
        if index is not None and self.qs.device.type == "cpu":
            rows = _native_rows(self, index)
            if rows is not None:
                return rows
        qs, d, m = (self.qs, self.d, self.m) if index is None else (self.qs[index], self.d[index], self.m[index])
        q = unpack_quants(qs, self.bits, self.in_features).float()
        blocks = q.view(q.shape[0], -1, BLOCK) * d.unsqueeze(-1) + m.unsqueeze(-1)
        return blocks.view(q.shape[0], self.in_features)


def _native_rows(weight: QuantizedWeight, index: torch.Tensor) -> torch.Tensor | None:
    """`weight.dequantize(index)` by csrc/linear/quant_linear.c; None without the library. An index
    out of range raises IndexError, as the torch path does."""
    lib = cpu_kernels.load_library()
    if lib is None:
        return None
    index = index.to(torch.int64).contiguous()
    out = torch.empty(index.numel(), weight.in_features, dtype=torch.float32)
    if lib.kvserve_quant_embed(weight.qs.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr(), weight.bits,
                               weight.out_features, weight.in_features, index.data_ptr(), index.numel(),
                               out.data_ptr()):
        raise IndexError(f"row index out of range for a weight of {weight.out_features} rows")
    return out


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one width by rows (the parts of a fused projection); parts of
    fewer bits are widened, exactly, to the widest part's (a Q4_K query next to a Q6_K
    value projection)."""
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        raise QuantizationError("fused parts differ in width")
    bits = max(p.bits for p in parts)
    parts = [widen(p, bits) for p in parts]
    names = "+".join(dict.fromkeys(p.source_type for p in parts))
    return dataclasses.replace(parts[0], qs=torch.cat([p.qs for p in parts]), d=torch.cat([p.d for p in parts]),
                               m=torch.cat([p.m for p in parts]), source_type=names)


def widen(weight: QuantizedWeight, bits: int) -> QuantizedWeight:
    """The same values with quants of `bits` (at least the weight's own) bits."""
    if weight.bits == bits:
        return weight
    q = unpack_quants(weight.qs, weight.bits, weight.in_features).numpy()
    return dataclasses.replace(weight, qs=torch.from_numpy(pack_quants(q, bits)), bits=bits)


# ---- layout -------------------------------------------------------------------------

def pack_quants(q: np.ndarray, bits: int) -> np.ndarray:
    """q [rows, in] (uint8 0..15 for 4 bits, int8 for 8, int16 for 16) -> the kernel's byte layout."""
    rows, cols = q.shape
    if bits == 16:
        return np.ascontiguousarray(q.astype(np.int16)).view(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(q.astype(np.int8).view(np.uint8))
    q = q.astype(np.uint8)
    groups = cols // GROUP_COLS
    head = q[:, :groups * GROUP_COLS].reshape(rows, groups, 2, 64)
    head = head[:, :, 0] | (head[:, :, 1] << 4)
    tail = q[:, groups * GROUP_COLS:].reshape(rows, -1, 2, 16)
    tail = tail[:, :, 0] | (tail[:, :, 1] << 4)
    return np.ascontiguousarray(np.concatenate([head.reshape(rows, -1), tail.reshape(rows, -1)], axis=1))


def unpack_quants(qs: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of `pack_quants` (in torch): int16 [rows, cols]."""
    rows = qs.shape[0]
    if bits == 16:
        return qs.contiguous().view(torch.int16)
    if bits == 8:
        return qs.view(torch.int8).to(torch.int16)
    groups = cols // GROUP_COLS
    head = qs[:, :groups * 64].reshape(rows, groups, 1, 64)
    head = torch.cat([head & 15, head >> 4], dim=2).reshape(rows, -1)
    tail = qs[:, groups * 64:].reshape(rows, -1, 1, 16)
    tail = torch.cat([tail & 15, tail >> 4], dim=2).reshape(rows, -1)
    return torch.cat([head, tail], dim=1).to(torch.int16)


# ---- GGUF blocks -> (q, d, m) --------------------------------------------------------

def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of GGUF order -> [..., 32] quants (low nibbles first)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _decode_q4_0(blocks: np.ndarray):
    d = _f16(blocks[..., 0:2])[..., 0]
    return _nibbles(blocks[..., 2:18]), d, -8.0 * d, 4


def _decode_q4_1(blocks: np.ndarray):
    d, m = _f16(blocks[..., 0:2])[..., 0], _f16(blocks[..., 2:4])[..., 0]
    return _nibbles(blocks[..., 4:20]), d, m, 4


def _decode_q8_0(blocks: np.ndarray):
    d = _f16(blocks[..., 0:2])[..., 0]
    return blocks[..., 2:34].view(np.int8), d, np.zeros_like(d), 8


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32, bit j for column j) -> [..., 32] values 0 or 16."""
    return (np.unpackbits(qh, axis=-1, bitorder="little") << 4).astype(np.uint8)


def _decode_q5_0(blocks: np.ndarray):
    """Five-bit quants held as 8-bit weights (q - 16, signed), exactly."""
    d = _f16(blocks[..., 0:2])[..., 0]
    q = (_nibbles(blocks[..., 6:22]) | _fifth_bits(blocks[..., 2:6])).astype(np.int16) - 16
    return q.astype(np.int8), d, np.zeros_like(d), 8


def _decode_q5_1(blocks: np.ndarray):
    d, m = _f16(blocks[..., 0:2])[..., 0], _f16(blocks[..., 2:4])[..., 0]
    return (_nibbles(blocks[..., 8:24]) | _fifth_bits(blocks[..., 4:8])).view(np.int8), d, m, 8


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 sub-blocks' d and m of Q4_K / Q5_K super-blocks: f16 d, dmin, then 12 bytes
    of 6-bit scales and mins."""
    rows, supers = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2])[..., 0], _f16(blocks[..., 2:4])[..., 0]
    s = blocks[..., 4:16].astype(np.uint8)
    scales = np.empty((rows, supers, 8), np.float32)
    mins = np.empty((rows, supers, 8), np.float32)
    scales[..., :4], mins[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    scales[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (d[..., None] * scales).reshape(rows, -1), (-dmin[..., None] * mins).reshape(rows, -1)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, supers, 128] bytes -> [rows, supers, 8, 32] quants: per 64 columns 32 bytes,
    low nibbles the first 32 columns, high nibbles the next 32."""
    rows, supers = qs.shape[:2]
    qs = qs.reshape(rows, supers, 4, 32)
    return np.concatenate([qs[..., None, :] & 15, qs[..., None, :] >> 4], axis=-2).reshape(rows, supers, 8, 32)


def _decode_q4_k(blocks: np.ndarray):
    """Super-blocks of 256: scales (see `_k_scales`), then 128 bytes of nibbles."""
    d, m = _k_scales(blocks)
    return _k_nibbles(blocks[..., 16:144]).reshape(blocks.shape[0], -1, 32), d, m, 4


def _decode_q5_k(blocks: np.ndarray):
    """As Q4_K, with 32 bytes of fifth bits before the nibbles (bit 2j / 2j + 1 of byte l:
    column l of sub-block 2j / 2j + 1); held as 8-bit weights, exactly."""
    rows, supers = blocks.shape[:2]
    d, m = _k_scales(blocks)
    bits = np.unpackbits(blocks[..., 16:48], axis=-1, bitorder="little").reshape(rows, supers, 32, 8)
    high = (np.moveaxis(bits, -1, -2) << 4).astype(np.uint8)  # [rows, supers, 8 sub-blocks, 32]
    q = _k_nibbles(blocks[..., 48:176]) | high
    return q.reshape(rows, -1, 32).view(np.int8), d, m, 8


def _decode_q6_k(blocks: np.ndarray):
    """Super-blocks of 256: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8
    scales (one per 16 columns), f16 d. Per 128 columns (64 + 32 bytes): columns l and
    32 + l take the low nibbles of bytes l and 32 + l, columns 64 + l and 96 + l their high
    nibbles; the high pairs are bits 0-1, 2-3, 4-5, 6-7 of byte l for those four columns.
    Held as 16-bit weights, exactly: q = (6-bit quant - 32) * scale, one d per super-block."""
    rows, supers = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(rows, supers, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # columns 0-31, 32-63, 64-95, 96-127 of a half
    high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    q = (low | (high << 4)).astype(np.int16) - 32  # [rows, supers, 2, 4, 32]
    scales = blocks[..., 192:208].view(np.int8).astype(np.int16).reshape(rows, supers, 2, 4, 2, 1)
    q = (q.reshape(rows, supers, 2, 4, 2, 16) * scales).reshape(rows, -1, 32)
    d = np.repeat(_f16(blocks[..., 208:210])[..., 0], 8, axis=-1)
    return q, d, np.zeros_like(d), 16


_DECODERS = {"Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q8_0": _decode_q8_0, "Q4_K": _decode_q4_k,
             "Q5_0": _decode_q5_0, "Q5_1": _decode_q5_1, "Q5_K": _decode_q5_k, "Q6_K": _decode_q6_k}


def from_gguf_blocks(type_name: str, raw: np.ndarray, in_features: int) -> QuantizedWeight:
    """Repack a GGUF tensor's raw bytes [rows, bytes per row] (type `type_name`) for the kernel."""
    if type_name not in _DECODERS:
        raise QuantizationError(f"no kernel for GGUF type {type_name}")
    block_bytes, block_cols = _GGUF_LAYOUTS[type_name]
    if in_features % block_cols or raw.shape[1] != in_features // block_cols * block_bytes:
        raise QuantizationError(f"{type_name}: {raw.shape[1]} bytes per row do not hold {in_features} columns")
    rows = raw.shape[0]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, block_bytes)
    q, d, m, bits = _DECODERS[type_name](blocks)
    packed = pack_quants(q.reshape(rows, in_features), bits)
    return QuantizedWeight(torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(d, np.float32)),
                           torch.from_numpy(np.ascontiguousarray(m, np.float32)), bits, in_features, type_name)


# ---- the kernel ----------------------------------------------------------------------

_isa_choice: dict[int, str] = {}  # ceiling code -> chosen path


def kernel_isa(kernel_config: KernelConfig | None = None) -> str | None:
    """The kernel path a model with `kernel_config` (default: all switches on) uses ("avx512",
    "avx2", "portable"), or None without native kernels: the widest the CPU runs, capped at
    `kernel_config.quant_isa`."""
    config = kernel_config or KernelConfig()
    if not config.cpu_kernels:
        return None
    if cpu_kernels.load_library() is None:
        return None
    ceiling = ISA_CODES[config.quant_isa] if config.quant_isa else max(ISA_CODES.values())
    if ceiling not in _isa_choice:
        _isa_choice[ceiling] = dispatch.widest("quant", QUANT_ISAS[ceiling])
    return _isa_choice[ceiling]


def isa_available(isa: str) -> bool:
    """Whether this build and CPU run the kernel path `isa`."""
    return dispatch.available("quant", isa)


def dequantize_dense(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole weight as a dense [out, in] tensor of `dtype` (float32 or bfloat16), by
    the native kernel: the values d * q + m, rounded to bfloat16 if asked."""
    w = torch.empty(weight.out_features, weight.in_features, dtype=dtype)
    code = cpu_kernels.load_library().kvserve_quant_dequantize(
        weight.qs.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr(), weight.bits, weight.out_features,
        weight.in_features, w.data_ptr(), 0 if dtype == torch.float32 else 1, torch.get_num_threads())
    if code:
        raise cpu_kernels.KernelArgumentError(f"dequantization rejected its arguments (code {code})")
    return w


def gemm_dtype(kernel_config: KernelConfig | None = None) -> torch.dtype:
    """The dtype of the dense GEMM of many-row steps: `kernel_config.quant_gemm_dtype`, else
    bfloat16 on CPUs with native bfloat16 and float32 elsewhere."""
    name = (kernel_config or KernelConfig()).quant_gemm_dtype
    if name is None:
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def _dense_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    w = dequantize_dense(weight, dtype)
    y = torch.nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
    return y.to(x.dtype)


def _kernel_operands(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None):
    """x [rows, in] as the kernels read it (float32 or bfloat16, contiguous rows), the bias
    in x's dtype, and the output [rows, out] to fill."""
    if x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float().contiguous() if x.dtype not in (torch.float32, torch.bfloat16) else x.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    return x, bias, x.new_empty(x.shape[0], weight.out_features)


def panel_isa(weight: QuantizedWeight) -> str:
    """The panel GEMM's path for `weight`: its kernel path, where the panel kernel has it
    (the AVX-512 one needs AVX512-BF16 and multiplies in bfloat16, so a float32 `gemm_dtype`
    takes the AVX2 one), else the next narrower one."""
    isa = weight.isa or kernel_isa() or "portable"
    if isa == "avx512" and weight.gemm_dtype == torch.float32:
        isa = "avx2"
    while isa != "portable" and not dispatch.available("quant_gemm", isa):
        isa = QUANT_ISAS[ISA_CODES[isa] - 1]
    return isa


def panel_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> torch.Tensor:
    """x [rows, in] @ W^T (+ bias) by the panel GEMM (csrc/linear/quant_gemm.c): for steps of many
    rows it expands W once per call, a panel of rows at a time, and multiplies in bfloat16
    (AVX512-BF16) or float32; x float32 or bfloat16 (rows may be strided), the result of
    x's dtype. `isa` (default `panel_isa(weight)`) picks the path."""
    x, bias, y = _kernel_operands(x, weight, bias)
    code = cpu_kernels.load_library().kvserve_quant_gemm(
        x.data_ptr(), x.stride(0), x.shape[0], weight.qs.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr(),
        weight.bits, weight.out_features, weight.in_features, bias.data_ptr() if bias is not None else None,
        y.data_ptr(), y.stride(0), 0 if x.dtype == torch.float32 else 1, ISA_CODES[isa or panel_isa(weight)],
        torch.get_num_threads())
    if code:
        raise cpu_kernels.KernelArgumentError(f"panel GEMM rejected its arguments (code {code})")
    return y


def _single_row_kernel(weight: QuantizedWeight, isa: str) -> bool:
    """Whether a one-row step takes quant_gemv.c's kernel (as kvserve_quant_single_row_kernel)."""
    return weight.act_bits == 8 and isa == "avx512"


def linear(x: torch.Tensor, weight: QuantizedWeight | StoredWeight, bias: torch.Tensor | None = None,
           isa: str | None = None, num_draft_rows: int = 0) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with W quantized; x float32 or bfloat16 on the CPU
    (rows may be strided), the result of x's dtype. `isa` overrides the weight's path.
    Steps of `weight.gemm_rows` rows or more dequantize W and run a dense GEMM instead.
    A `StoredWeight` (GGUF blocks as the file holds them) runs `stored_weight.linear`.

    `num_draft_rows` of the rows are a speculative verify step's drafts: the kernel is
    chosen as for a step without them, so the step's rows go through the kernel, and the
    activation rounding, that plain decoding of the same sequences would use, and greedy
    speculative decoding emits exactly its tokens (the panel GEMM and the row kernel round
    activations differently)."""
    if isinstance(weight, StoredWeight):
        return stored_weight.linear(x, weight, bias, isa, num_draft_rows)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.shape[-1] != weight.in_features:
        raise cpu_kernels.KernelArgumentError(f"input width {x2.shape[-1]}, weight takes {weight.in_features}")
    plain_rows = x2.shape[0] - num_draft_rows
    if isa is None and weight.gemm_rows and plain_rows >= weight.gemm_rows:
        return _dense_linear(x2, weight, bias, weight.gemm_dtype).view(*lead, weight.out_features)
    if isa is None and weight.panel_rows and plain_rows >= weight.panel_rows:
        return panel_linear(x2, weight, bias).view(*lead, weight.out_features)
    isa = isa or weight.isa or kernel_isa()
    if plain_rows == 1 and x2.shape[0] > 1 and _single_row_kernel(weight, isa):
        rows = [_row_kernel_linear(x2[i:i + 1], weight, bias, isa) for i in range(x2.shape[0])]
        return torch.cat(rows).view(*lead, weight.out_features)
    return _row_kernel_linear(x2, weight, bias, isa).view(*lead, weight.out_features)


def _row_kernel_linear(x2: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                       isa: str) -> torch.Tensor:
    """x2 [rows, in] @ W^T (+ bias) by the row kernel (csrc/linear/quant_linear.c) on path `isa`."""
    x2, bias, y = _kernel_operands(x2, weight, bias)
    code = cpu_kernels.load_library().kvserve_quant_linear(
        x2.data_ptr(), x2.stride(0), x2.shape[0], weight.qs.data_ptr(), weight.d.data_ptr(), weight.m.data_ptr(),
        weight.bits, weight.out_features, weight.in_features, bias.data_ptr() if bias is not None else None,
        y.data_ptr(), y.stride(0), 0 if x2.dtype == torch.float32 else 1, weight.act_bits, ISA_CODES[isa],
        torch.get_num_threads())
    if code:
        raise cpu_kernels.KernelArgumentError(f"quantized matmul rejected its arguments (code {code})")
    return y


# ---- choosing the path ----------------------------------------------------------------

def keeps_quantized(model_config, device: str | torch.device, kernel_config: KernelConfig | None = None) -> bool:
    """Whether the loader keeps `model_config`'s GGUF tensors quantized: quantization
    "auto", on the CPU, with the native kernels allowed and built."""
    return (model_config.is_gguf and model_config.quantization == "auto"
            and torch.device(device).type == "cpu" and kernel_isa(kernel_config) is not None)


def stored_types(kernel_config: KernelConfig | None = None) -> frozenset[str]:
    """The GGUF type names the loader holds as stored (`StoredWeight`): those whose kernels run
    on the quantized kernel path `kernel_config` picks; it repacks the others the older kernel
    takes. None with int16 activations (KVSERVE_QUANT_ACT_BITS=16): the stored-block kernels
    round activations to int8 only."""
    kernel_config = kernel_config or KernelConfig()
    isa = kernel_isa(kernel_config)
    if isa is None or kernel_config.quant_act_bits != 8:
        return frozenset()
    return frozenset(name for name in stored_weight.GGML_TYPE_IDS if stored_weight.supported(name, isa))


def _kept_types(kernel_config: KernelConfig | None = None) -> frozenset[str]:
    """GGUF type names some kernel takes as they are (stored) or repacked."""
    return stored_types(kernel_config) | frozenset(SUPPORTED_GGUF_TYPES)


def holds_quantized_weights(model_config, device: str | torch.device,
                            kernel_config: KernelConfig | None = None) -> bool:
    """Whether the loader keeps some of `model_config`'s matrices quantized (`keeps_quantized`
    and the file has a type the kernels take)."""
    return (keeps_quantized(model_config, device, kernel_config)
            and any(name in _kept_types(kernel_config) for name in _file_matrix_types(model_config.path)))


def _file_matrix_types(path: str) -> dict[str, int]:
    """GGUF type name -> count of matrices (2-D tensors and 3-D stacks of experts) of that
    type in the file."""
    from kvserve.model.gguf_file import open_gguf
    counts: dict[str, int] = {}
    for tensor in open_gguf(path).tensors:
        if len(tensor.shape) in (2, 3):
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bfloat16 natively on this CPU (AVX512-BF16 / AMX)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def default_dtype(path: str, quantization: str, device: str, kernel_config: KernelConfig | None = None) -> str:
    """The activation dtype when none is given, logged once: float32 where the file's
    weights stay quantized (the kernels take float32 activations and quantize them per
    block themselves) or off the CPU; for dequantized GGUF weights bfloat16 on CPUs
    with native bfloat16; float32 otherwise (and for Hugging Face checkpoints)."""
    if str(device).split(":")[0] != "cpu" or not path.endswith(".gguf"):  # validated later
        return "float32"
    types = _file_matrix_types(path)
    kept = {name: n for name, n in types.items() if name in _kept_types(kernel_config)}
    isa = kernel_isa(kernel_config)
    if quantization == "auto" and kept and isa is not None:
        logger.info("GGUF weights %s kept quantized (%s kernels), activations float32", "/".join(sorted(kept)), isa)
        return "float32"
    dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    logger.info("GGUF weights dequantized to %s (%s)", dtype,
                "quantization none" if quantization == "none" else "no kernel for " + "/".join(sorted(types)))
    return dtype
