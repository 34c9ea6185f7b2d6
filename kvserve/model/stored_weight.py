"""GGUF weights computed as stored (#27): a matrix held in the file's own block layout
(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, and the types csrc/linear/gguf/ adds), at its stored size,
possibly a view of the mmapped file.

The kernels are csrc/linear/gguf_rows.c: a step of a few rows quantizes its activations
per 32 columns to int8 (as `quantized.QuantizedWeight` with act_bits 8 and llama.cpp do)
and takes integer sums against the blocks as they lie; from 9 rows, types with a GEMM on
the path (csrc/linear/gguf_gemm.c: Q4_K, Q6_K, Q8_0 and Q5_0 on AVX-512 VNNI) run it, with every row
bit for bit its batch-one result, at any step size. For the other types, steps of
`gemm_rows` rows or more dequantize the weight (bfloat16 on CPUs with native bfloat16,
`quantized.gemm_dtype`) and run a dense GEMM, where the matmul is compute-bound. Types the
kernels do not take keep the repacked `QuantizedWeight` (`supported` says which).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.native import abi, cpu_kernels, dispatch
from kvserve.native import isa as isa_table

# ggml's type ids of the block types (gguf.GGMLQuantizationType).
GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
                 "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "MXFP4": 39}
_DTYPE_CODES = abi.DTYPE_CODES


class StoredWeightError(ValueError):
    """A tensor cannot be held as stored (a type or shape the kernels do not take)."""


def _lib():
    lib = cpu_kernels.load_library()
    if lib is None:
        raise StoredWeightError("GGUF blocks as stored need the native kernels, which are not built here")
    return lib


def supported(type_name: str, isa: str) -> bool:
    """Whether rows of GGUF type `type_name` run on kernel path `isa` here."""
    lib = cpu_kernels.load_library()
    return (lib is not None and type_name in GGML_TYPE_IDS
            and bool(lib.kvserve_gguf_supported(GGML_TYPE_IDS[type_name], isa_table.ISA_CODES[isa])))


def row_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one row of `in_features` columns; StoredWeightError where the kernels lack the
    type or the row is not whole blocks."""
    size = int(_lib().kvserve_gguf_row_bytes(GGML_TYPE_IDS.get(type_name, -1), in_features))
    if size < 0:
        raise StoredWeightError(f"no as-stored kernel for a {type_name} row of {in_features} columns")
    return size


@dataclass
class StoredWeight:
    """One [out, in] weight in its GGUF block layout: `blocks` uint8 [out, row bytes] (may
    be a view of the mmapped file), `ggml_type` ggml's id of `type_name`. `isa`: the kernel
    path (None: the widest here). Steps of at least `gemm_rows` rows (0: never) dequantize it
    to `gemm_dtype` and run a dense GEMM."""

    blocks: torch.Tensor
    ggml_type: int
    type_name: str
    in_features: int
    isa: str | None = None
    gemm_rows: int = 0
    gemm_dtype: torch.dtype = torch.float32

    # The kernels round activations to int8 per 32 columns (tests/helpers/activation_rounding.py).
    act_bits = 8

    def __post_init__(self) -> None:
        expected = row_bytes(self.type_name, self.in_features)
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.blocks.shape[1] != expected:
            raise StoredWeightError(f"{self.type_name} blocks of {self.in_features} columns take uint8 rows of "
                                    f"{expected} bytes, got {self.blocks.dtype} {tuple(self.blocks.shape)}")
        if self.blocks.stride(1) != 1 or self.blocks.stride(0) != expected:
            raise StoredWeightError("stored blocks must be contiguous rows")

    @property
    def source_type(self) -> str:
        """The GGUF type name (as `QuantizedWeight.source_type`)."""
        return self.type_name

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor | slice) -> "StoredWeight":
        """The weight restricted to some rows (a tensor-parallel slice, a permutation): a copy
        unless `index` is a slice, whose rows stay a view."""
        blocks = self.blocks[index]
        return dataclasses.replace(self, blocks=blocks if isinstance(index, slice) else blocks.contiguous())

    def dequantize(self, index: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values [rows, in] of all rows or of the rows `index` (1-D int64: an embedding
        lookup), float32 exactly as the file's (ggml's formulas), or rounded to bfloat16.
        An index out of range raises IndexError."""
        rows = None
        if index is not None:
            rows = index.reshape(-1).to(torch.int64).contiguous()
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.out_features):
                raise IndexError(f"row index out of range for a weight of {self.out_features} rows")
        count = self.out_features if rows is None else rows.numel()
        out = torch.empty(count, self.in_features, dtype=dtype)
        code = _lib().kvserve_gguf_dequantize(self.blocks.data_ptr(), self.ggml_type, self.in_features,
                                              None if rows is None else rows.data_ptr(), count, out.data_ptr(),
                                              _DTYPE_CODES[dtype])
        if code:
            raise cpu_kernels.KernelArgumentError(f"GGUF dequantization rejected {self.type_name} as {dtype}")
        return out


def from_gguf_blocks(type_name: str, raw: np.ndarray | torch.Tensor, in_features: int, **options) -> StoredWeight:
    """A GGUF tensor's raw bytes [rows, bytes per row] held as they are (no copy where they
    are already contiguous uint8: a read-only mmap stays one, never written to)."""
    if type_name not in GGML_TYPE_IDS:
        raise StoredWeightError(f"no as-stored kernel for GGUF type {type_name}")
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():  # a read-only mmap: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))
    return StoredWeight(raw, GGML_TYPE_IDS[type_name], type_name, in_features, **options)


_widest: list[str | None] = []


def _default_isa() -> str:
    if not _widest:
        _widest.append(dispatch.widest("quant"))
    return _widest[0] or "portable"


_native_gemm: dict[tuple[int, str], bool] = {}


def has_native_gemm(weight: StoredWeight, isa: str | None = None) -> bool:
    """Whether many-row steps of `weight` on path `isa` (None: the weight's) run the native GEMM
    (csrc/linear/gguf_gemm.c), which keeps every row's batch-one sums, instead of a dense one."""
    key = (weight.ggml_type, isa or weight.isa or _default_isa())
    if key not in _native_gemm:
        _native_gemm[key] = bool(_lib().kvserve_gguf_gemm_supported(key[0], isa_table.ISA_CODES[key[1]]))
    return _native_gemm[key]


def linear(x: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None = None, isa: str | None = None,
           num_draft_rows: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) with W as stored; x float32 or bfloat16 on the CPU (rows may
    be strided), the result of x's dtype. `isa` overrides the weight's path (and keeps the
    row kernel at any row count). Steps of `weight.gemm_rows` rows or more, not counting
    `num_draft_rows` speculative drafts, dequantize W and run a dense GEMM unless the type has
    a native GEMM here (`has_native_gemm`); the row kernel and the native GEMM give every row
    the sums a batch-one step gives it, so verify steps match plain decoding. `out`: a contiguous
    float32 [rows, out_features] to write the result into (float32 x only)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[-1] != weight.in_features:
        raise cpu_kernels.KernelArgumentError(f"input width {rows.shape[-1]}, weight takes {weight.in_features}")
    if (isa is None and weight.gemm_rows and rows.shape[0] - num_draft_rows >= weight.gemm_rows
            and not has_native_gemm(weight)):
        dtype = weight.gemm_dtype
        y = torch.nn.functional.linear(rows.to(dtype), weight.dequantize(dtype=dtype),
                                       None if bias is None else bias.to(dtype))
        y = y.to(x.dtype) if out is None else out.copy_(y)
        return y.view(*lead, weight.out_features)
    return _row_kernel(rows, weight, bias, isa or weight.isa or _default_isa(), out).to(x.dtype).view(
        *lead, weight.out_features)


def _row_kernel(rows: torch.Tensor, weight: StoredWeight, bias: torch.Tensor | None, isa: str,
                y: torch.Tensor | None = None) -> torch.Tensor:
    if rows.dtype != torch.float32 or rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.float().contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    if y is None:
        y = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
    x_stride = max(rows.stride(0), rows.shape[1])  # a one-row view may carry any row stride
    code = _lib().kvserve_gguf_linear(rows.data_ptr(), x_stride, rows.shape[0], weight.blocks.data_ptr(),
                                      weight.ggml_type, weight.in_features,
                                      None if bias is None else bias.data_ptr(), y.data_ptr(), weight.out_features,
                                      isa_table.ISA_CODES[isa])
    if code == -2:
        raise cpu_kernels.KernelArgumentError(f"the {isa} path of the GGUF kernels does not run on this CPU")
    if code:
        raise cpu_kernels.KernelArgumentError(f"GGUF {weight.type_name} matmul rejected its arguments (code {code})")
    return y
