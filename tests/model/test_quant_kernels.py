"""The quantized-weight matmul (csrc/linear/quant_linear.c via kvserve/model/quantized.py)
against float64 references built from gguf's own dequantization, per GGUF type,
on every kernel path this CPU runs, with row and column tails, odd shapes,
strided and bfloat16 inputs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvserve.native.config import QUANT_ACT_BITS_ENV, QUANT_GEMM_DTYPE_ENV, QUANT_GEMM_ROWS_ENV, QUANT_ISA_ENV, KernelConfig
from kvserve.errors import ConfigError
from kvserve.native import cpu_kernels
from kvserve.model import quantized

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from gguf import quants  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None,
                                reason="the native CPU kernels could not be built (no C compiler?)")
ISAS = [isa for isa in quantized.ISA_CODES if cpu_kernels.load_library() and quantized.isa_available(isa)]
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]
K_TYPES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block of 256 columns
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q6_K": 16}  # the others: 8
# in_features: one block, a group plus tail blocks, odd block counts, the default model's widths.
WIDTHS = {"K": [256, 768, 1536], "other": [32, 96, 160, 288, 576, 1536]}


def gguf_blocks(type_name: str, out: int, width: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes [out, bytes per row] of a random weight of `type_name`."""
    rng = np.random.default_rng(seed)
    if type_name not in K_TYPES:
        weight = rng.standard_normal((out, width)).astype(np.float32)
        weight[0, :32] = 0.0  # an all-zero block (d = 0)
        return quants.quantize(weight, getattr(QType, type_name))
    # gguf has no K-quant quantizers: random super-blocks with sane f16 scales.
    supers = rng.integers(0, 256, (out, width // 256, K_TYPES[type_name]), dtype=np.uint8)
    if type_name == "Q6_K":  # d last; the int8 scales stay random, negative ones included
        supers[..., 208:210] = np.frombuffer(np.float16(0.0011).tobytes(), np.uint8)
        return supers.reshape(out, -1)
    supers[..., 0:2] = np.frombuffer(np.float16(0.011).tobytes(), np.uint8)
    supers[..., 2:4] = np.frombuffer(np.float16(0.007).tobytes(), np.uint8)
    return supers.reshape(out, -1)


def reference_weight(type_name: str, raw: np.ndarray, width: int) -> np.ndarray:
    return quants.dequantize(raw, getattr(QType, type_name)).reshape(raw.shape[0], width).astype(np.float64)


def rounded_activations(x: np.ndarray, bits: int) -> np.ndarray:
    """x rounded as the kernel quantizes it: per block of 32, to int8 (scale amax / 127) or
    int16 (amax / 32767)."""
    blocks = x.astype(np.float64).reshape(x.shape[0], -1, 32)
    top = 127.0 if bits == 8 else 32767.0
    scale = np.abs(blocks).max(axis=-1, keepdims=True).astype(np.float32).astype(np.float64) / top
    q = np.rint(np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale > 0))
    return (q * scale).reshape(x.shape)


def cases():
    for type_name in TYPES:
        for width in WIDTHS["K" if type_name in K_TYPES else "other"]:
            yield type_name, width


@pytest.mark.parametrize("type_name,width", list(cases()))
def test_repacked_blocks_dequantize_exactly_like_gguf(type_name, width):
    raw = gguf_blocks(type_name, 7, width, seed=width)
    weight = quantized.from_gguf_blocks(type_name, raw, width)
    assert weight.bits == BITS.get(type_name, 8)
    np.testing.assert_allclose(weight.dequantize().double().numpy(), reference_weight(type_name, raw, width),
                               rtol=1e-6, atol=1e-7)
    rows = torch.tensor([6, 0, 3, 6])
    # Looked-up rows (an embedding) come from one native call: the very values of the table.
    torch.testing.assert_close(weight.dequantize(rows), weight.dequantize()[rows], rtol=0, atol=0)
    with pytest.raises(IndexError):
        weight.dequantize(torch.tensor([0, 7]))


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,width", list(cases()))
def test_kernel_matches_float64_reference(type_name, width, isa, act_bits):
    out = 13  # three tiles of four rows and a one-row tail
    raw = gguf_blocks(type_name, out, width, seed=out + width)
    weight = dataclasses.replace(quantized.from_gguf_blocks(type_name, raw, width), act_bits=act_bits)
    if weight.bits == 16:  # sixteen-bit weights always take int16 activations
        assert weight.act_bits == 16
        act_bits = 16
    w64 = reference_weight(type_name, raw, width)
    rng = np.random.default_rng(width)
    for batch in (1, 3, 6):  # a batch tail after a tile of four rows of x
        x = rng.standard_normal((batch, width)).astype(np.float32)
        bias = rng.standard_normal(out).astype(np.float32)
        y = quantized.linear(torch.from_numpy(x), weight, torch.from_numpy(bias), isa=isa).double().numpy()
        # Against the weights and the kernel's int8 activations: only float32 sum order differs.
        exact = rounded_activations(x, act_bits) @ w64.T + bias
        np.testing.assert_allclose(y, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
        # Against the unrounded activations: each x moves by at most half a rounding step.
        full = x.astype(np.float64) @ w64.T + bias
        half_step = np.repeat(np.abs(x).reshape(batch, -1, 32).max(-1) / (254.0 if act_bits == 8 else 65534.0), 32, 1)
        assert (np.abs(y - full) <= half_step @ np.abs(w64).T + 1e-4 * np.abs(full).max()).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_takes_strided_and_bfloat16_inputs(type_name, isa):
    width = 512 if type_name in K_TYPES else 160
    weight = quantized.from_gguf_blocks(type_name, gguf_blocks(type_name, 5, width, seed=3), width)
    wide = torch.randn(4, width + 48, generator=torch.Generator().manual_seed(1))
    strided = wide[:, 16:16 + width]  # rows 48 elements apart
    expected = quantized.linear(strided.contiguous(), weight, isa=isa)
    torch.testing.assert_close(quantized.linear(strided, weight, isa=isa), expected, rtol=0, atol=0)
    x16 = strided.to(torch.bfloat16)
    y16 = quantized.linear(x16, weight, isa=isa)
    assert y16.dtype == torch.bfloat16
    reference = x16.double() @ weight.dequantize().double().T
    assert (y16.double() - reference).abs().max() <= 0.02 * reference.abs().max()
    # Leading dimensions are kept.
    assert quantized.linear(strided.reshape(2, 2, width), weight, isa=isa).shape == (2, 2, 5)


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("type_name", TYPES)
def test_every_kernel_path_gives_the_same_integer_sums(type_name, act_bits):
    width = 768
    weight = quantized.from_gguf_blocks(type_name, gguf_blocks(type_name, 9, width, seed=5), width)
    weight = dataclasses.replace(weight, act_bits=act_bits)
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(2))
    results = [quantized.linear(x, weight, isa=isa) for isa in ISAS]
    for other in results[1:]:  # float32 sums in another order (scaled as the float64 test's tolerance:
        # the blocks' minimum terms can cancel most of a sum)
        torch.testing.assert_close(other, results[0], rtol=1e-4, atol=1e-4 * results[0].abs().max().item())


def test_large_batch_runs_threaded_and_matches_small_batches():
    width = 576
    weight = quantized.from_gguf_blocks("Q4_1", gguf_blocks("Q4_1", 300, width, seed=9), width)
    x = torch.randn(40, width, generator=torch.Generator().manual_seed(4))
    isa = quantized.kernel_isa()  # the integer kernel, not the dense path of many-row steps
    whole = quantized.linear(x, weight, isa=isa)
    parts = torch.cat([quantized.linear(x[i:i + 1], weight, isa=isa) for i in range(40)])
    # Rows of one take the single-row kernel (quant_gemv.c) on AVX512-VNNI: same integer
    # sums, float32 sums in another order.
    torch.testing.assert_close(whole, parts, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_rejected():
    weight = quantized.from_gguf_blocks("Q8_0", gguf_blocks("Q8_0", 4, 64, seed=1), 64)
    with pytest.raises(cpu_kernels.KernelArgumentError):
        quantized.linear(torch.randn(2, 96), weight)
    with pytest.raises(quantized.QuantizationError):
        quantized.from_gguf_blocks("Q2_K", np.zeros((2, 84), np.uint8), 256)
    with pytest.raises(quantized.QuantizationError):
        quantized.from_gguf_blocks("Q4_0", np.zeros((2, 17), np.uint8), 32)


def test_isa_switch_forces_a_narrower_path():
    for wanted in ("portable", "avx2"):
        expected = wanted if quantized.isa_available(wanted) else "portable"
        assert quantized.kernel_isa(KernelConfig.from_env({QUANT_ISA_ENV: wanted})) == expected
    assert quantized.kernel_isa(KernelConfig(cpu_kernels=False)) is None
    with pytest.raises(ConfigError, match=QUANT_ISA_ENV):
        KernelConfig.from_env({QUANT_ISA_ENV: "sse9"})
    with pytest.raises(ConfigError, match=QUANT_ACT_BITS_ENV):
        KernelConfig.from_env({QUANT_ACT_BITS_ENV: "4"})


@pytest.mark.parametrize("type_name,width", list(cases()))
def test_dense_dequantization_matches_gguf(type_name, width):
    raw = gguf_blocks(type_name, 9, width, seed=width + 1)
    weight = quantized.from_gguf_blocks(type_name, raw, width)
    dense = quantized.dequantize_dense(weight, torch.float32)
    np.testing.assert_allclose(dense.double().numpy(), reference_weight(type_name, raw, width), rtol=1e-6, atol=1e-7)
    # bfloat16: the same values, rounded as torch rounds them.
    torch.testing.assert_close(quantized.dequantize_dense(weight, torch.bfloat16), dense.to(torch.bfloat16),
                               rtol=0, atol=0)


@pytest.mark.parametrize("gemm_dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.02)])
@pytest.mark.parametrize("type_name", TYPES)
def test_many_row_steps_run_a_dense_gemm(type_name, gemm_dtype, tolerance):
    width, out = (512, 37) if type_name in K_TYPES else (160, 37)
    raw = gguf_blocks(type_name, out, width, seed=11)
    weight = dataclasses.replace(quantized.from_gguf_blocks(type_name, raw, width), gemm_rows=8, gemm_dtype=gemm_dtype)
    w64 = reference_weight(type_name, raw, width)
    wide = torch.randn(21, width + 16, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(out, generator=torch.Generator().manual_seed(7))
    for x in (wide[:, 8:8 + width], wide[:, :width].to(torch.bfloat16)):  # strided float32, bfloat16
        for rows in (8, 21):
            y = quantized.linear(x[:rows], weight, bias)
            assert y.dtype == x.dtype and y.shape == (rows, out)
            reference = x[:rows].double().numpy() @ w64.T + bias.double().numpy()
            allowed = max(tolerance, 0.02 if x.dtype == torch.bfloat16 else 0.0) * np.abs(reference).max()
            assert np.abs(y.double().numpy() - reference).max() <= allowed
    # Fewer rows than the threshold stay on the integer kernel.
    few = wide[:7, :width].contiguous()
    torch.testing.assert_close(quantized.linear(few, weight), quantized.linear(few, weight, isa=quantized.kernel_isa()),
                               rtol=0, atol=0)


def test_gemm_switches_are_read_and_checked():
    config = KernelConfig.from_env({QUANT_GEMM_ROWS_ENV: "0", QUANT_GEMM_DTYPE_ENV: "Float32"})
    assert (config.quant_gemm_rows, quantized.gemm_dtype(config)) == (0, torch.float32)
    default = KernelConfig.from_env({})
    assert default.quant_gemm_rows == 320
    assert quantized.gemm_dtype(default) == (torch.bfloat16 if quantized.cpu_has_native_bf16() else torch.float32)
    for env, bad in ((QUANT_GEMM_ROWS_ENV, "many"), (QUANT_GEMM_ROWS_ENV, "-1"), (QUANT_GEMM_DTYPE_ENV, "fp8")):
        with pytest.raises(ConfigError, match=env):
            KernelConfig.from_env({env: bad})


def test_fused_parts_of_different_bits_are_widened_exactly():
    parts = [quantized.from_gguf_blocks(name, gguf_blocks(name, rows, 512, seed=rows), 512)
             for name, rows in (("Q4_K", 5), ("Q8_0", 3), ("Q6_K", 2))]
    fused = quantized.cat_rows(parts)
    assert fused.bits == 16 and fused.source_type == "Q4_K+Q8_0+Q6_K" and fused.shape == (10, 512)
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(8))
    # Sixteen-bit weights take int16 activations: so must the parts they are compared with.
    parts16 = [dataclasses.replace(p, act_bits=16) for p in parts]
    torch.testing.assert_close(quantized.linear(x, fused), torch.cat([quantized.linear(x, p) for p in parts16], dim=1),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act_bits", [8, 16])
def test_activation_rounding_follows_its_definition_exactly(act_bits):
    """kvserve_quant_activations (vectorized for int8 where the CPU has AVX-512) against the
    rule written out in float32: quants rint(x * (top / amax)) exactly, scale amax / top,
    sx = scale * sum q."""
    lib = cpu_kernels.load_library()
    top = np.float32(127.0 if act_bits == 8 else 32767.0)
    rng = np.random.default_rng(11)
    for width in (32, 96, 576, 1536):
        x = (rng.standard_normal((3, width)) * rng.choice([1e-3, 1.0, 30.0], (3, 1))).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block
        x[1, width // 2 + 3] = 200.0  # an outlier in its block
        qx = torch.zeros(3 * width * (act_bits // 8) + 64, dtype=torch.uint8)
        scales = torch.zeros(2 * 3 * width // 32)
        lib.kvserve_quant_activations(torch.from_numpy(x).data_ptr(), width, 3, width, act_bits, qx.data_ptr(),
                                      scales.data_ptr())
        blocks = x.reshape(3, -1, 32)
        amax = np.abs(blocks).max(-1, keepdims=True)
        inv = np.divide(top, amax, out=np.zeros_like(amax), where=amax > 0)
        q = np.rint(blocks * inv).astype(np.int64)
        dtype = np.int8 if act_bits == 8 else np.int16
        got = qx[:3 * width * (act_bits // 8)].numpy().view(dtype).reshape(3, -1, 32)
        np.testing.assert_array_equal(got, q)
        dx = (amax / top)[..., 0]
        # -ffast-math may divide by 127 as a multiply by its reciprocal: the last bit of dx.
        np.testing.assert_allclose(scales[:3 * width // 32].numpy(), dx.reshape(-1), rtol=2e-7)
        np.testing.assert_allclose(scales[3 * width // 32:].numpy(), (dx * q.sum(-1)).reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_1"])
def test_int8_rows_are_batch_invariant_on_the_single_row_kernel(type_name):
    """With int8 activations on AVX512-VNNI every activation row of a step gets exactly the
    sums of a batch-one step (quant_gemv.c, weight rows a chunk at a time across the batch):
    a request decodes the same alone or next to others, and a speculative verify step's rows
    as its one-token steps. Above the chunk of 64 rows and with a row tail."""
    if "avx512" not in ISAS:
        pytest.skip("no AVX512-VNNI here")
    width = 256 if type_name.endswith("K") else 576
    weight = quantized.from_gguf_blocks(type_name, gguf_blocks(type_name, 150, width, seed=9), width)
    weight = dataclasses.replace(weight, act_bits=8)
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([quantized.linear(x[i:i + 1], weight, isa="avx512") for i in range(6)])
    for batch in (2, 3, 6):
        assert torch.equal(quantized.linear(x[:batch], weight, isa="avx512"), alone[:batch])


@pytest.mark.parametrize("type_name,width,bounds", [
    ("Q4_1", 576, [0, 8, 18]),  # the default model's O input: two runs, the second with two tail blocks
    ("Q4_0", 576, [0, 4, 8, 12, 18]),
    ("Q8_0", 416, [0, 8, 13]),  # 8-bit weights: a run of four blocks and a tail of one
    ("Q5_1", 96, [0, 3]),  # held as 8-bit weights; a single run shorter than a group
    ("Q4_K", 768, [0, 8, 16, 24]),
    ("Q4_1", 800, [8, 16, 25]),  # runs that do not start at the row's first block
])
def test_partial_products_of_block_runs(type_name, width, bounds):
    """`kvserve_gemv_partials` (the native decoder's matmuls split by input columns): each
    run's partial products against a float64 reference over the run's columns (the kernel's
    int8 activations, gguf's dequantized weights); each run's sums are the same taken alone
    as next to other runs; a single run over the whole row gives the one-row kernel's sums."""
    if "avx512" not in ISAS:
        pytest.skip("no AVX512-VNNI here")
    lib, out = cpu_kernels.load_library(), 13  # three runs of four rows and a one-row tail
    raw = gguf_blocks(type_name, out, width, seed=width + len(bounds))
    weight = dataclasses.replace(quantized.from_gguf_blocks(type_name, raw, width), act_bits=8)
    assert weight.bits in (4, 8)
    x = np.random.default_rng(width).standard_normal((1, width)).astype(np.float32)
    nb = width // 32
    qx, scales = torch.empty(width, dtype=torch.int8), torch.empty(2 * nb)
    lib.kvserve_quant_activations(x.ctypes.data, width, 1, width, 8, qx.data_ptr(), scales.data_ptr())

    def partials(run_bounds: list[int], mins: bool = True) -> torch.Tensor:
        y = torch.full((len(run_bounds) - 1, out), float("nan"))
        b = torch.tensor(run_bounds, dtype=torch.int64)
        assert lib.kvserve_gemv_partials(qx.data_ptr(), scales.data_ptr(), scales.data_ptr() + 4 * nb,
                                         weight.qs.data_ptr(), weight.d.data_ptr(),
                                         weight.m.data_ptr() if mins else None, weight.bits, width, b.data_ptr(),
                                         len(run_bounds) - 1, y.data_ptr(), out, 0, out) == 1
        return y

    y = partials(bounds)
    xr, w64 = rounded_activations(x, 8)[0], reference_weight(type_name, raw, width)
    for c, (b0, b1) in enumerate(zip(bounds, bounds[1:])):
        cols = slice(32 * b0, 32 * b1)
        exact = w64[:, cols] @ xr[cols]
        np.testing.assert_allclose(y[c].double().numpy(), exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
        assert torch.equal(partials([b0, b1])[0], y[c])
    if not weight.m.any():  # Q8_0: minimums not read at all (how the native call passes them)
        assert torch.equal(partials(bounds, mins=False), y)
    whole = partials([0, nb])[0]
    assert torch.equal(whole, quantized.linear(torch.from_numpy(x), weight, isa="avx512")[0])
