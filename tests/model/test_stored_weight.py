"""GGUF blocks computed as stored (csrc/linear/gguf_rows.c, kvserve/model/stored_weight.py):
dequantization against gguf-py's (an independent implementation of ggml's formulas), and
the row kernel on every path this machine runs against a float64 product.

The bound of the row kernel. It quantizes x per 32 columns to int8, x ~ dx * qx
(kvserve_quant_activations); the oracle takes those same rounded activations xq = dx * qx,
so activation rounding is not part of the comparison. A type's kernel splits each weight
value as w = A - B: A the part that scales the quant (d * sc * q, summed as integers
against qx, exactly), B the block's minimum or offset (times sx = dx * sum qx). Every output
is a float32 sum of terms, each a product of at most four rounded float32 factors (a relative
error of at most 4u, u = 2^-24), and the sum's error is at most u times the sum over terms of
|term| times the additions it passes through. Per 32 columns there are at most two terms (the
scale term and the minimum term; per 16 columns for Q2_K's minimums, Q3_K and Q6_K's scales,
still at most two additions per 32 columns in one lane): T <= 2 in / 32 + 2 per 256 columns
in all. A term passes through at most T - 1 additions in a scalar sum; the vector tiles keep
8 or 16 lanes, each a chain of at most T additions, then add the lanes (at most 4 levels), the
separately summed minimum terms and the bias (2): at most T + 6. The oracle's dequantized w is
ggml's float32 value, which differs from the exact A - B by at most 3u (|A| + |B|) (d * sc,
* q, - m). So |kernel - oracle| <= (T + 13) u S with S = sum_i (|A_i| + |B_i|) |xq_i|. S is taken
from the blocks themselves without a second decoder: B is the value of the same block with
its quant bytes zeroed (w0), A = w - w0, and |A| + |B| <= |w - w0| + |w0| for every type
(for types with no B, w0 is some value and the sum only grows). The float64 oracle's own
error (2^-53 relative per operation) is far below and not counted.
"""
from __future__ import annotations

import ctypes
import threading

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from kvserve.model import quantized, stored_weight
from kvserve.model.stored_weight import StoredWeight, StoredWeightError
from kvserve.native import build, dispatch
from kvserve.native.isa import ISA_CODES, ISAS

pytestmark = pytest.mark.skipif(build.load_library() is None, reason="no C compiler for the native kernels")

U = 2.0 ** -24
# Bytes of a block that hold its quants (zeroed to find the block's minimum/offset part).
QUANT_BYTES = {"Q4_0": slice(2, 18), "Q4_1": slice(4, 20), "Q8_0": slice(2, 34), "Q4_K": slice(16, 144),
               "Q6_K": slice(0, 192), "Q5_0": slice(2, 22), "Q5_1": slice(4, 24), "Q5_K": slice(16, 176),
               "Q3_K": slice(0, 96), "Q2_K": slice(16, 80), "IQ4_NL": slice(2, 18), "IQ4_XS": slice(8, 136),
               "MXFP4": slice(1, 17)}
# Types gguf-py does not quantize are random bytes but for their f16 scales: (first byte, how
# many f16 values, range). A signed range where the quants are signed (the sign of d matters).
F16_SCALES = {"Q4_K": (0, 2, 0.001, 0.02), "Q6_K": (208, 1, 0.0005, 0.005), "Q5_K": (0, 2, 0.001, 0.02),
              "Q3_K": (108, 1, -0.02, 0.02), "Q2_K": (80, 2, 0.001, 0.02), "IQ4_NL": (0, 1, -0.02, 0.02),
              "IQ4_XS": (0, 1, -0.002, 0.002)}
TYPES = tuple(QUANT_BYTES)
PATHS = [isa for isa in ISAS if dispatch.available("quant", isa)]


def _random_blocks(type_name: str, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """rows x in_features of `type_name` as uint8 [rows, row bytes]: quantized by gguf-py where it
    can quantize the type, else random bytes with finite, moderate f16 scales."""
    qtype = gguf.GGMLQuantizationType[type_name]
    values = rng.standard_normal((rows, in_features)).astype(np.float32)
    try:
        return quants.quantize(values, qtype)
    except NotImplementedError:
        pass
    block_cols, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, in_features // block_cols, block_bytes), dtype=np.uint8)

    first, count, low, high = F16_SCALES[type_name]
    scales = rng.uniform(low, high, (rows, blocks.shape[1], count)).astype(np.float16)
    blocks[..., first:first + 2 * count] = scales.view(np.uint8).reshape(rows, blocks.shape[1], 2 * count)
    return blocks.reshape(rows, -1)


def _weight(type_name: str, rows: int, in_features: int, seed: int = 0, **options) -> StoredWeight:
    return stored_weight.from_gguf_blocks(type_name, _random_blocks(type_name, rows, in_features,
                                                                    np.random.default_rng(seed)), in_features, **options)


def _gguf_py(weight: StoredWeight) -> np.ndarray:
    return quants.dequantize(weight.blocks.numpy(), gguf.GGMLQuantizationType[weight.type_name])


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_gguf_py_bit_for_bit(type_name):
    weight = _weight(type_name, 7, 512)
    expected = torch.from_numpy(_gguf_py(weight))
    assert torch.equal(weight.dequantize().view(torch.int32), expected.view(torch.int32))
    index = torch.tensor([6, 0, 3, 3])
    assert torch.equal(weight.dequantize(index), expected[index])
    assert torch.equal(weight.dequantize(dtype=torch.bfloat16), expected.to(torch.bfloat16))


def test_dequantize_refuses_a_row_out_of_range():
    weight = _weight("Q4_0", 3, 64)
    with pytest.raises(IndexError):
        weight.dequantize(torch.tensor([3]))
    with pytest.raises(IndexError):
        weight.dequantize(torch.tensor([-1]))


def test_row_bytes_and_bad_shapes():
    assert stored_weight.row_bytes("Q4_K", 512) == 2 * 144
    assert stored_weight.row_bytes("Q6_K", 256) == 210
    with pytest.raises(StoredWeightError):
        stored_weight.row_bytes("Q4_K", 100)
    with pytest.raises(StoredWeightError):
        stored_weight.from_gguf_blocks("F16", np.zeros((2, 64), np.uint8), 32)
    with pytest.raises(StoredWeightError):
        stored_weight.from_gguf_blocks("Q8_0", np.zeros((2, 35), np.uint8), 32)


def _quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qx int8 [batch, in] and the scales [2, batch, in / 32] (dx, then dx * sum qx) the kernel makes."""
    batch, in_features = x.shape
    qx = torch.empty(batch, in_features, dtype=torch.int8)
    scales = torch.empty(2, batch, in_features // 32, dtype=torch.float32)
    build.load_library().kvserve_quant_activations(x.data_ptr(), x.stride(0), batch, in_features, 8, qx.data_ptr(),
                                                   scales.data_ptr())
    return qx, scales


def _oracle_and_bound(weight: StoredWeight, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """float64 W xq^T with xq the int8-rounded activations, and the bound of the header."""
    qx, scales = _quantized_activations(x)
    xq = (qx.double().view(x.shape[0], -1, 32) * scales[0].double().unsqueeze(-1)).view(x.shape).numpy()
    w = _gguf_py(weight).astype(np.float64)
    zeroed = weight.blocks.numpy().copy().reshape(weight.out_features, -1, gguf.GGML_QUANT_SIZES[
        gguf.GGMLQuantizationType[weight.type_name]][1])
    zeroed[..., QUANT_BYTES[weight.type_name]] = 0
    w0 = quants.dequantize(zeroed.reshape(weight.out_features, -1),
                           gguf.GGMLQuantizationType[weight.type_name]).astype(np.float64)
    magnitude = np.abs(xq) @ (np.abs(w - w0) + np.abs(w0)).T
    terms = 2 * weight.in_features // 32 + 2 * weight.in_features // 256
    return xq @ w.T, (terms + 13) * U * magnitude


def _odd_width(type_name: str) -> int:
    """A row width of an odd number of blocks (the vector paths take blocks two at a time)."""
    return 800 if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0] == 32 else 768


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_linear_matches_the_float64_product_of_the_rounded_activations(type_name, isa, batch):
    width = _odd_width(type_name)
    weight = _weight(type_name, 37, width, seed=batch)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(batch))
    expected, bound = _oracle_and_bound(weight, x)
    y = stored_weight.linear(x, weight, isa=isa).double().numpy()
    assert np.all(np.abs(y - expected) <= bound), np.max(np.abs(y - expected) / bound)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("type_name", TYPES)
def test_each_row_gets_its_batch_one_sums_whatever_the_batch_and_range(type_name, isa):
    """Rows computed in a batch of 17, in any row range, are bit for bit the batch-one rows
    (speculative verify steps rely on it)."""
    width = _odd_width(type_name)
    weight = _weight(type_name, 23, width, seed=5)
    x = torch.randn(17, width, generator=torch.Generator().manual_seed(7))
    batched = stored_weight.linear(x, weight, isa=isa)
    for b in (0, 5, 16):
        assert torch.equal(batched[b], stored_weight.linear(x[b:b + 1], weight, isa=isa)[0])
    qx, scales = _quantized_activations(x)
    pieces = torch.full((17, 23), float("nan"))
    for begin, end in ((0, 3), (3, 10), (10, 23)):
        build.load_library().kvserve_gguf_rows(qx.data_ptr(), scales.data_ptr(), 17, weight.blocks.data_ptr(),
                                               weight.ggml_type, width, None, pieces.data_ptr(), 23, ISA_CODES[isa],
                                               begin, end)
    assert torch.equal(pieces, batched)


def test_bias_strided_rows_and_bfloat16_inputs():
    weight = _weight("Q4_K", 9, 256, seed=3)
    x = torch.randn(4, 2, 256, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(9, generator=torch.Generator().manual_seed(4))
    plain = stored_weight.linear(x[:, 0].contiguous(), weight)
    assert torch.equal(stored_weight.linear(x[:, 0], weight, bias), plain + bias)
    assert stored_weight.linear(x.to(torch.bfloat16), weight).dtype == torch.bfloat16
    one = x[0, :1]
    assert torch.equal(stored_weight.linear(one.expand(3, 256), weight), plain[:1].expand(3, 9))  # stride 0
    with pytest.raises(ValueError, match="input width"):
        stored_weight.linear(torch.zeros(1, 128), weight)


@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
def test_prefill_sized_steps_run_a_dense_gemm(gemm_dtype):
    """From `gemm_rows` rows the weight is dequantized and multiplied densely: float32 within
    float32 summation of `in` products (in u sum |w x|), bfloat16 within the rounding of
    both operands to bfloat16 (half an ulp: 2^-8 relative each, their product 2^-16) and of
    the bfloat16 result (2^-8 of at most sum |w x|) plus that summation."""
    weight = _weight("Q5_K", 40, 512, seed=9, gemm_rows=8, gemm_dtype=gemm_dtype)  # no native GEMM
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(9))
    w = _gguf_py(weight).astype(np.float64)
    expected = x.double().numpy() @ w.T
    magnitude = np.abs(x.double().numpy()) @ np.abs(w).T
    rounding = 0.0 if gemm_dtype == torch.float32 else 3 * 2.0 ** -8 + 2.0 ** -16
    y = stored_weight.linear(x, weight).double().numpy()
    assert np.all(np.abs(y - expected) <= (512 * U + rounding) * magnitude)
    # Drafts do not count: 8 rows of which 1 a draft take the row kernel, as 7 plain rows would.
    eight = x[:8]
    assert torch.equal(stored_weight.linear(eight, weight, num_draft_rows=1),
                       stored_weight.linear(eight, weight, isa=weight.isa or PATHS[-1]))


def test_quantized_linear_takes_a_stored_weight():
    weight = _weight("Q8_0", 6, 64, seed=2)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(quantized.linear(x, weight), stored_weight.linear(x, weight))


def test_rows_of_a_stored_weight():
    weight = _weight("Q4_1", 10, 64, seed=4)
    part = weight.rows(slice(2, 5))
    assert part.shape == (3, 64) and part.nbytes() == 3 * 40
    assert torch.equal(part.dequantize(), weight.dequantize()[2:5])
    picked = weight.rows(torch.tensor([9, 1]))
    assert torch.equal(picked.dequantize(), weight.dequantize(torch.tensor([9, 1])))


def test_supported_types_follow_the_table():
    assert all(stored_weight.supported(name, "portable") for name in TYPES)
    # The types of most downloaded files have a tile on every vector path this machine runs.
    assert all(stored_weight.supported(name, isa) for name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
               for isa in PATHS)
    lib = build.load_library()
    assert lib.kvserve_gguf_supported(1, ISA_CODES["portable"]) == 0  # F16: not a block type here
    assert ctypes.c_int64(lib.kvserve_gguf_row_bytes(1, 64)).value == -1


def _split_bounds(weight: StoredWeight, granule: int = 0) -> list[int]:
    """The fused decoder's runs of a split by input columns (whole multiples of `granule`
    columns where the width allows): their bounds in 32-column blocks."""
    lib = build.load_library()
    runs = lib.kvserve_gguf_split_runs(weight.ggml_type, weight.in_features, granule)
    return [lib.kvserve_gguf_split_bound(weight.ggml_type, weight.in_features, granule, c) for c in range(runs + 1)]


def test_split_runs_are_whole_granules_where_the_width_allows():
    """O's runs are whole heads (granule 64) so that threads holding whole heads hold whole runs:
    SmolLM2's 9 heads of 64 over Q4_1 blocks; a K type's blocks of 256 hold 4 such heads."""
    q4_1, q4_k = _weight("Q4_1", 1, 576), _weight("Q4_K", 1, 2048)
    assert _split_bounds(q4_1) == [0, 4, 9, 13, 18]
    assert _split_bounds(q4_1, 64) == [0, 4, 8, 12, 18]
    assert _split_bounds(q4_k, 64) == _split_bounds(q4_k) == [0, 16, 32, 48, 64]
    assert _split_bounds(_weight("Q4_1", 1, 96), 64) == [0, 3]  # not whole heads: blocks, too few for 4 runs


def _partials(weight: StoredWeight, qx: torch.Tensor, scales: torch.Tensor, bounds: list[int], isa: str,
              rows: tuple[int, int]) -> torch.Tensor:
    """kvserve_gguf_partials of rows [rows[0], rows[1]) over the runs `bounds`: [runs, batch, out]
    (NaN outside those rows)."""
    batch, out = qx.shape[0], weight.out_features
    y = torch.full((len(bounds) - 1, batch, out), float("nan"))
    runs = torch.tensor(bounds, dtype=torch.int64)
    build.load_library().kvserve_gguf_partials(qx.data_ptr(), scales.data_ptr(), batch, weight.blocks.data_ptr(),
                                               weight.ggml_type, weight.in_features, runs.data_ptr(),
                                               len(bounds) - 1, y.data_ptr(), out, batch * out, ISA_CODES[isa],
                                               *rows)
    return y


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("type_name", TYPES)
def test_split_partials_add_up_and_do_not_depend_on_the_split(type_name, isa):
    """The fused decoder's O/down projections split by input columns (kvserve_gguf_partials):
    the runs are GGUF_SPLIT_RUNS of whole blocks fixed by the type and width alone; a run's
    partial products are the same bit for bit whatever the other runs, the row range and the
    batch; one run over the whole row is the row kernel's sum; and the runs added in order are
    within the header's bound, each of the (runs - 1) additions of partial sums counted once
    more (T + 13 + GGUF_SPLIT_RUNS)."""
    block_cols = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    width = 800 if block_cols == 32 else 1280  # 25 blocks / 5 super-blocks: uneven runs
    weight = _weight(type_name, 23, width, seed=11)
    bounds = _split_bounds(weight)
    per = block_cols // 32
    assert len(bounds) == 5 and bounds[0] == 0 and bounds[-1] == width // 32
    assert all(b % per == 0 for b in bounds) and all(a < b for a, b in zip(bounds, bounds[1:]))
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(12))
    qx, scales = _quantized_activations(x)
    split = _partials(weight, qx, scales, bounds, isa, (0, 23))
    for c in range(len(bounds) - 1):  # each run alone, some rows alone, one batch row alone
        alone = _partials(weight, qx, scales, bounds[c:c + 2], isa, (5, 18))[0]
        assert torch.equal(alone[:, 5:18], split[c][:, 5:18])
        one = _partials(weight, qx[3:4].contiguous(), scales[:, 3:4].contiguous(), bounds[c:c + 2], isa, (0, 23))
        assert torch.equal(one[0, 0], split[c, 3])
    whole = _partials(weight, qx, scales, [0, width // 32], isa, (0, 23))[0]
    assert torch.equal(whole, stored_weight.linear(x, weight, isa=isa))
    expected, bound = _oracle_and_bound(weight, x)
    terms = 2 * width // 32 + 2 * width // 256
    assert np.all(np.abs(split.sum(0, dtype=torch.float64).numpy() - expected) <=
                  bound / (terms + 13) * (terms + 13 + len(bounds) - 1))


def test_split_rows_quantize_each_block_alone():
    """The split quantizes only its runs' columns of a row (kvserve_quant_activation_blocks):
    bit for bit the blocks a whole-row quantization gives."""
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(13))
    qx, scales = _quantized_activations(x)
    part_q = torch.empty(3, 96, dtype=torch.int8)
    part_s = torch.empty(3, 2, 3)
    for t in range(3):
        build.load_library().kvserve_quant_activation_blocks(x[t, 128:].data_ptr(), 96, part_q[t].data_ptr(),
                                                             part_s[t, 0].data_ptr(), part_s[t, 1].data_ptr())
    assert torch.equal(part_q, qx[:, 128:224])
    assert torch.equal(part_s.permute(1, 0, 2), scales[:, :, 4:7])


# ---- the many-row GEMM (csrc/linear/gguf_gemm.c) ------------------------------------------
# Steps of kvserve_gguf_gemm_min_batch() rows or more take it where the type has one on the
# path (Q4_K, Q6_K, Q8_0, Q5_0 and MXFP4 on AVX-512 VNNI); elsewhere the same tests run the tiles.
GEMM_TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "MXFP4")


def _gemm_width(type_name: str) -> int:
    """Three super-blocks of a 256-column type; for a 32-column type 25 blocks, not whole
    super-blocks (the GEMM pads the last one with zero blocks) and an odd count (the batch-one
    tile's last group of 8 is partial and ends in a single block)."""
    return 768 if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0] == 256 else 800


def _gemm_batches() -> list[int]:
    """Just below and at the GEMM's threshold, one full lane group, and a batch that leaves a
    group of 9 lanes (16 lanes a group)."""
    least = build.load_library().kvserve_gguf_gemm_min_batch()
    return [least - 1, least, 16, 41]


def test_the_gemm_runs_where_the_tiles_it_matches_run():
    lib = build.load_library()
    for name in GEMM_TYPES:
        code = stored_weight.GGML_TYPE_IDS[name]
        assert lib.kvserve_gguf_gemm_supported(code, ISA_CODES["avx512"]) == int("avx512" in PATHS)
        assert lib.kvserve_gguf_gemm_supported(code, ISA_CODES["portable"]) == 0
    assert lib.kvserve_gguf_gemm_supported(stored_weight.GGML_TYPE_IDS["Q4_1"], ISA_CODES["avx512"]) == 0
    assert lib.kvserve_gguf_gemm_min_batch() > 1


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_gemm_matches_the_float64_product_and_the_batch_one_rows(type_name, isa):
    """Every batch size around the threshold, 37 rows (not whole panels of 16 or kernel calls
    of 8), _gemm_width columns, a bias: within the header's bound of the float64 product, and
    each row bit for bit its batch-one value. The header's bound holds for the GEMM (its lane
    chains add at most two terms per 32 columns of a super-block, one per padding block of
    Q8_0, then three levels and the bias); the bias's own magnitude adds u |bias| to the
    rounding of that last addition."""
    width = _gemm_width(type_name)
    weight = _weight(type_name, 37, width, seed=11)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(12))
    for batch in _gemm_batches():
        x = torch.randn(batch, width, generator=torch.Generator().manual_seed(batch))
        expected, bound = _oracle_and_bound(weight, x)
        y = stored_weight.linear(x, weight, bias, isa=isa)
        assert np.all(np.abs(y.double().numpy() - bias.double().numpy() - expected) <= bound + np.abs(
            bias.double().numpy()) * U), batch
        for b in {0, batch // 2, batch - 1}:
            assert torch.equal(y[b], stored_weight.linear(x[b:b + 1], weight, bias, isa=isa)[0]), (batch, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_gemm_rows_do_not_depend_on_the_range_or_the_threads(type_name, threads):
    """The fused decoder's per-thread row ranges (kvserve_gguf_rows) and kvserve_gguf_linear's
    split over one or two threads give every row its batch-one bits."""
    isa = PATHS[-1]
    weight = _weight(type_name, 45, 512, seed=13)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(14))
    ones = _batch_one_rows(x, weight, isa)
    assert torch.equal(_linear_on_threads(x, weight, isa, threads), ones)
    qx, scales = _quantized_activations(x)
    pieces = torch.full((33, 45), float("nan"))
    for begin, end in ((0, 5), (5, 22), (22, 45)):
        build.load_library().kvserve_gguf_rows(qx.data_ptr(), scales.data_ptr(), 33, weight.blocks.data_ptr(),
                                               weight.ggml_type, 512, None, pieces.data_ptr(), 45, ISA_CODES[isa],
                                               begin, end)
    assert torch.equal(pieces, ones)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_sized_activations_rounded_by_the_threads_keep_the_batch_one_bits(threads):
    """A step of 300 rows of 1,024 columns (past the 2**18 values from which kvserve_gguf_linear
    shares the rounding of its rows out over the threads; one thread rounds them all): every
    row's result equals its batch-one result bit for bit."""
    isa = PATHS[-1]
    weight = _weight(GEMM_TYPES[0], 24, 1024, seed=21)
    x = torch.randn(300, 1024, generator=torch.Generator().manual_seed(22))
    assert torch.equal(_linear_on_threads(x, weight, isa, threads), _batch_one_rows(x, weight, isa))


def _linear_on_threads(x: torch.Tensor, weight, isa: str, threads: int) -> torch.Tensor:
    """`stored_weight.linear` of all of x's rows in one step on `threads` threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return stored_weight.linear(x, weight, isa=isa)
    finally:
        torch.set_num_threads(saved)


def _batch_one_rows(x: torch.Tensor, weight, isa: str) -> torch.Tensor:
    """Each of x's rows multiplied alone (a batch-one step), stacked."""
    return torch.cat([stored_weight.linear(x[b:b + 1], weight, isa=isa) for b in range(x.shape[0])])


def _extreme_blocks(type_name: str, rows: int, in_features: int) -> np.ndarray:
    """Blocks whose integer sums are the largest the format allows: Q4_K every quant 15 and
    every 6-bit scale and minimum 63; Q6_K every value -32 (all bits zero) and every scale -128;
    Q8_0 every quant -128; Q5_0 every value -16 (all bits zero); MXFP4 every value -12 (code 15,
    stored doubled: -6 times 2^(e - 127)) at e = 120."""
    block_cols, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    blocks = np.zeros((rows, in_features // block_cols, block_bytes), dtype=np.uint8)
    if type_name == "MXFP4":
        blocks[..., 0] = 120
        blocks[..., 1:17] = 0xFF
    elif type_name in ("Q8_0", "Q5_0"):
        blocks[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
        blocks[..., 2:34] = 0x80 if type_name == "Q8_0" else 0
    elif type_name == "Q4_K":
        blocks[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
        blocks[..., 2:4] = np.array([0.002], np.float16).view(np.uint8)
        blocks[..., 4:16] = 0xFF
        blocks[..., 16:144] = 0xFF
    else:
        blocks[..., 192:208] = 0x80
        blocks[..., 208:210] = np.array([0.001], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_gemm_integer_sums_at_the_formats_extremes(type_name, isa):
    """Activations of one sign at full int8 scale against the extreme blocks: the integer sums
    reach their largest magnitude (Q6_K: 2 * 128 * 16 * 32 * 127 per 32 columns, just under
    2^24; Q8_0: 32 * 128 * 127, its GEMM's unsigned sum of (x + 128) q 32 * 255 * 128; MXFP4's
    tile: 32 * 24 * 127 for the values plus 12 against qx) and must
    stay exact, so the results stay within the float64 bound and equal batch one."""
    width = _gemm_width(type_name)
    weight = stored_weight.from_gguf_blocks(type_name, _extreme_blocks(type_name, 19, width), width)
    signs = torch.tensor([(-1.0) ** b for b in range(20)]).unsqueeze(1)
    x = signs * torch.ones(20, width)  # every activation +-127 after rounding
    expected, bound = _oracle_and_bound(weight, x)
    y = stored_weight.linear(x, weight, isa=isa)
    assert np.all(np.abs(y.double().numpy() - expected) <= bound)
    assert torch.equal(y[7], stored_weight.linear(x[7:8], weight, isa=isa)[0])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_gemm_chunks_of_a_wide_row_keep_the_batch_one_rows(type_name):
    """Steps of one or two lane groups (16, 32 rows) of Q4_K and Q6_K go a strip and 8
    super-blocks at a time, the accumulators carried from chunk to chunk: 2,560 columns take a
    chunk of 8 and one of 2, 13 rows a full strip and a partial one; every row keeps its
    batch-one bits (the same float order), with a bias, in the float64 bound."""
    isa = PATHS[-1]
    weight = _weight(type_name, 13, 2560, seed=18)
    bias = torch.randn(13, generator=torch.Generator().manual_seed(19))
    for batch in (16, 32):
        x = torch.randn(batch, 2560, generator=torch.Generator().manual_seed(batch + 20))
        expected, bound = _oracle_and_bound(weight, x)
        y = stored_weight.linear(x, weight, bias, isa=isa)
        assert np.all(np.abs(y.double().numpy() - bias.double().numpy() - expected) <= bound + np.abs(
            bias.double().numpy()) * U), batch
        ones = torch.cat([stored_weight.linear(x[b:b + 1], weight, bias, isa=isa) for b in range(batch)])
        assert torch.equal(y, ones), batch


@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_gemm_over_several_panels_and_batch_slabs(type_name):
    """8,192 columns: the GEMM unpacks the rows in panels of about 384 KB (32 rows of Q4_K, Q8_0 or Q5_0, 24
    of Q6_K, so 40 rows take two) and packs the batch in slabs of 2 MB (256 rows, so 260 take
    two); every row keeps its batch-one bits and the float64 bound."""
    isa = PATHS[-1]
    weight = _weight(type_name, 40, 8192, seed=16)
    x = torch.randn(260, 8192, generator=torch.Generator().manual_seed(17))
    expected, bound = _oracle_and_bound(weight, x)
    y = stored_weight.linear(x, weight, isa=isa)
    assert np.all(np.abs(y.double().numpy() - expected) <= bound)
    for b in (0, 255, 256, 259):
        assert torch.equal(y[b], stored_weight.linear(x[b:b + 1], weight, isa=isa)[0]), b


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_gemm_buffers_kept_between_steps_of_any_shape(type_name, threads):
    """The GEMM keeps its packed activations and panel per thread between steps: steps that
    grow and shrink (columns, batch, rows not whole strips of 8 or lane groups of 16) each give
    every row its batch-one bits and stay within the float64 bound."""
    isa = PATHS[-1]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step, (rows, in_features, batch) in enumerate(((13, 512, 17), (45, 8192, 70),
                                                           (9, _gemm_width(type_name), 41), (21, 512, 12),
                                                           (40, 8192, 33))):
            weight = _weight(type_name, rows, in_features, seed=30 + step)
            x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(40 + step))
            expected, bound = _oracle_and_bound(weight, x)
            y = stored_weight.linear(x, weight, isa=isa)
            assert np.all(np.abs(y.double().numpy() - expected) <= bound), step
            for b in (0, batch // 2, batch - 1):
                assert torch.equal(y[b], stored_weight.linear(x[b:b + 1], weight, isa=isa)[0]), (step, b)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_gemm_from_threads_that_come_and_go(type_name):
    """Each calling thread gets its own GEMM buffers, freed when it ends: steps run from a
    series of short-lived threads (several at once) give the same bits as on this thread."""
    isa = PATHS[-1]
    weight = _weight(type_name, 21, _gemm_width(type_name), seed=50)
    x = torch.randn(40, _gemm_width(type_name), generator=torch.Generator().manual_seed(51))
    expected = stored_weight.linear(x, weight, isa=isa)
    results = []

    def step():
        results.append(stored_weight.linear(x, weight, isa=isa))

    for _ in range(3):
        threads = [threading.Thread(target=step) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == 12 and all(torch.equal(y, expected) for y in results)


@pytest.mark.parametrize("type_name", GEMM_TYPES)
def test_prefill_sized_steps_keep_the_native_gemm(type_name):
    """Where the type has a native GEMM on the weight's path, steps of `gemm_rows` rows or more
    run it rather than a dense GEMM: every row keeps its batch-one bits."""
    weight = _weight(type_name, 24, 512, seed=18, gemm_rows=12, gemm_dtype=torch.bfloat16)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(18))
    y = stored_weight.linear(x, weight)
    if not stored_weight.has_native_gemm(weight):
        pytest.skip(f"no native {type_name} GEMM on the widest path here ({PATHS[-1]})")
    assert all(torch.equal(y[b], stored_weight.linear(x[b:b + 1], weight)[0]) for b in range(13))


@pytest.mark.parametrize("isa", PATHS)
def test_mxfp4_exponents_over_the_whole_range(isa):
    """MXFP4's E8M0 exponents over their range: rows mixing e over 20..170 (weights from 2^-109
    to 2^43 times the values; every scale product d dx a normal float32 and every sum finite)
    within the header's bound, and rows whose blocks all have e in 0..3 (d = 2^-128 .. 2^-125:
    subnormal scales and products). The process may run with flush-to-zero and
    denormals-are-zero (gcc 12 sets both when it loads a -ffast-math shared library, as this
    one): a product d dx below 2^-126 (or a subnormal d read as 0) then loses up to 2^-126 |I|
    per block (|I| <= 32 * 12 * 128, the block's integer sum) and a flushed fused multiply-add
    up to 2^-126 more, and gguf-py's float32 dequantization (the oracle's w) flushes weights
    below 2^-126, up to 2^-126 sum |xq| over the row: that absolute term is added to the bound
    (negligible next to the sums of the wide rows). Batch rows keep their batch-one bits on the
    tiles and on the GEMM (41 rows)."""
    width, rows = 800, 19
    rng = np.random.default_rng(60)
    blocks = rng.integers(0, 256, (rows, width // 32, 17), dtype=np.uint8)
    blocks[:8, :, 0] = rng.integers(0, 4, (8, width // 32))
    blocks[8:, :, 0] = rng.integers(20, 171, (rows - 8, width // 32))
    weight = stored_weight.from_gguf_blocks("MXFP4", blocks.reshape(rows, -1), width)
    for batch in (1, 41):
        x = torch.randn(batch, width, generator=torch.Generator().manual_seed(61 + batch))
        expected, bound = _oracle_and_bound(weight, x)
        qx, scales = _quantized_activations(x)
        xq = qx.double().view(batch, -1, 32) * scales[0].double().unsqueeze(-1)
        flushed = 2.0 ** -126 * ((width // 32) * (32 * 12 * 128 + 2) + xq.abs().sum((1, 2)).numpy()[:, None])
        y = stored_weight.linear(x, weight, isa=isa)
        assert torch.isfinite(y).all() and (y[:, 8:].abs() > 1e-20).all()
        assert np.all(np.abs(y.double().numpy() - expected) <= bound + flushed), batch
        for b in {0, batch - 1}:
            assert torch.equal(y[b], stored_weight.linear(x[b:b + 1], weight, isa=isa)[0]), (batch, b)
