"""The panel GEMM of many-row steps (csrc/linear/quant_gemm.c via quantized.panel_linear)
against float64 references built from gguf's own dequantization, per GGUF type, on
every path this CPU runs (AVX512-BF16: bfloat16 panel; AVX2 and portable: float32),
with row, column and batch tails, strided and bfloat16 inputs, and its routing."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_quant_kernels import K_TYPES, TYPES, gguf_blocks, reference_weight

from kvserve.native.config import QUANT_PANEL_ROWS_ENV, KernelConfig
from kvserve.errors import ConfigError
from kvserve.native import cpu_kernels, dispatch
from kvserve.native import isa as isa_table
from kvserve.model import quantized

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None,
                                reason="the native CPU kernels could not be built (no C compiler?)")
PATHS = [path for path in isa_table.ISAS if dispatch.available("quant_gemm", path)]


def bf16_rounded(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a)).float().to(torch.bfloat16).double().numpy()


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("type_name", TYPES)
def test_panel_gemm_matches_float64_reference(type_name, isa):
    # widths with a group plus tail blocks (4-bit layout); 37 rows: two panels and a tail
    # that is not a whole micro-tile; batches with tails after tiles of 6 (and 2) rows
    out = 37
    for width in ((256, 768) if type_name in K_TYPES else (96, 160, 576)):
        raw = gguf_blocks(type_name, out, width, seed=out + width)
        weight = quantized.from_gguf_blocks(type_name, raw, width)
        w64 = reference_weight(type_name, raw, width)
        rng = np.random.default_rng(width)
        for batch in (1, 9, 13, 32):
            x = rng.standard_normal((batch, width)).astype(np.float32)
            bias = rng.standard_normal(out).astype(np.float32)
            y = quantized.panel_linear(torch.from_numpy(x), weight, torch.from_numpy(bias), isa=isa)
            y = y.double().numpy()
            if isa == "avx512":  # weights and activations rounded to bfloat16, float32 sums
                exact = bf16_rounded(x) @ bf16_rounded(w64).T + bias
                # the kernel rounds d * q + m from float32, the reference from float64: a tie
                # may round the other way, one bfloat16 step on a rare weight
                np.testing.assert_allclose(y, exact, rtol=1e-3, atol=2e-3 * np.abs(exact).max())
                full = x.astype(np.float64) @ w64.T + bias
                assert np.abs(y - full).max() <= 0.01 * np.abs(full).max()
            else:
                exact = x.astype(np.float64) @ w64.T + bias
                np.testing.assert_allclose(y, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())


@pytest.mark.parametrize("isa", PATHS)
def test_panel_gemm_takes_strided_and_bfloat16_inputs(isa):
    width, out = 288, 21
    weight = quantized.from_gguf_blocks("Q4_1", gguf_blocks("Q4_1", out, width, seed=2), width)
    wide = torch.randn(19, width + 40, generator=torch.Generator().manual_seed(3))
    strided = wide[:, 8:8 + width]
    expected = quantized.panel_linear(strided.contiguous(), weight, isa=isa)
    torch.testing.assert_close(quantized.panel_linear(strided, weight, isa=isa), expected, rtol=0, atol=0)
    x16 = strided.to(torch.bfloat16)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(4))
    y16 = quantized.panel_linear(x16, weight, bias, isa=isa)
    assert y16.dtype == torch.bfloat16 and y16.shape == (19, out)
    reference = x16.double() @ weight.dequantize().double().T + bias.to(torch.bfloat16).double()
    assert (y16.double() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_large_panel_gemm_runs_threaded_and_matches_row_by_row():
    width = 576
    weight = quantized.from_gguf_blocks("Q8_0", gguf_blocks("Q8_0", 700, width, seed=8), width)
    x = torch.randn(40, width, generator=torch.Generator().manual_seed(5))
    whole = quantized.panel_linear(x, weight)
    parts = torch.cat([quantized.panel_linear(x[i:i + 1], weight) for i in range(40)])
    torch.testing.assert_close(whole, parts, rtol=0, atol=0)  # each sum is computed the same way


def test_steps_are_routed_by_their_row_count():
    width, out = 160, 24
    weight = dataclasses.replace(quantized.from_gguf_blocks("Q4_0", gguf_blocks("Q4_0", out, width, seed=1), width),
                                 panel_rows=9, gemm_rows=64)
    x = torch.randn(80, width, generator=torch.Generator().manual_seed(6))
    integer = quantized.kernel_isa()
    torch.testing.assert_close(quantized.linear(x[:8], weight), quantized.linear(x[:8], weight, isa=integer),
                               rtol=0, atol=0)
    for rows in (9, 63):
        torch.testing.assert_close(quantized.linear(x[:rows], weight), quantized.panel_linear(x[:rows], weight),
                                   rtol=0, atol=0)
    dense = quantized._dense_linear(x, weight, None, weight.gemm_dtype)
    torch.testing.assert_close(quantized.linear(x, weight), dense, rtol=0, atol=0)


def test_float32_gemm_dtype_keeps_the_panel_in_float32():
    weight = dataclasses.replace(quantized.from_gguf_blocks("Q8_0", gguf_blocks("Q8_0", 4, 64, seed=1), 64),
                                 gemm_dtype=torch.float32)
    assert quantized.panel_isa(weight) in ("avx2", "portable")


def test_panel_switch_is_read_and_checked():
    assert KernelConfig.from_env({}).quant_panel_rows == 4
    assert KernelConfig.from_env({QUANT_PANEL_ROWS_ENV: "0"}).quant_panel_rows == 0
    for bad in ("some", "-3"):
        with pytest.raises(ConfigError, match=QUANT_PANEL_ROWS_ENV):
            KernelConfig.from_env({QUANT_PANEL_ROWS_ENV: bad})
