"""The paged attention kernel (csrc/attention/paged_attention.c) called directly, against a float64
reference computed from the cache as stored: every kernel path this CPU runs, float32,
bfloat16 and float16 caches, GQA ratios, head sizes the vector paths do and do not
take whole, odd context lengths, scattered blocks with holes (the null block and unused
blocks hold NaN: reading one would show), sliding windows and soft-capping, attention
sinks (gpt-oss). Also the K/V write's rounding to 16 bits against torch's."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.native import cpu_kernels
from helpers.attention_reference import paged_reference as _reference

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    cpu_kernels.load_library() is None or not cpu_kernels.attention_isa_available(isa),
    reason=f"{isa} path does not run on this CPU")) for isa in ("avx512", "avx2", "portable")]
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK = 16
# (query heads, KV heads, head size): SmolLM2's, no GQA, 8 query heads on one KV head, a head
# size the AVX-512 path does not take whole (AVX2 does), and one neither vector path takes.
SHAPES = [(9, 3, 64), (4, 4, 128), (8, 1, 64), (6, 2, 24), (4, 2, 12)]
CONTEXTS = [1, 15, 16, 17, 31, 100, 257]


def _paged_case(shape, kv_dtype, contexts, window, seed):
    """A cache whose requests' blocks are scattered, the rest (null block 0 included) NaN;
    a sliding window's blocks before the window are the null block in the table."""
    hq, hkv, d = shape
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // BLOCK) for n in contexts]
    num_blocks = sum(blocks_needed) + 8  # some blocks never handed out
    cache = torch.full((2, hkv, num_blocks, BLOCK, d), float("nan"))
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    width = max(blocks_needed)
    table = torch.zeros(len(contexts), width, dtype=torch.int64)
    for r, n in enumerate(contexts):
        for i in range(blocks_needed[r]):
            block = free.pop()
            filled = min(BLOCK, n - i * BLOCK)  # slots past the last key stay NaN
            cache[:, :, block, :filled] = torch.randn(2, hkv, filled, d, generator=generator)
            first_kept = max(0, n - 2 - window) // BLOCK if window else 0  # the chunk's first token's
            table[r, i] = block if i >= first_kept else 0
    cache = cache.to(kv_dtype)
    # The last token of every request, and for the longest also the two before it (a chunk).
    longest = max(range(len(contexts)), key=lambda r: contexts[r])
    rows = list(range(len(contexts))) + [longest, longest]
    positions = [n - 1 for n in contexts] + [contexts[longest] - 3, contexts[longest] - 2]
    q = torch.randn(len(rows), hq, d, generator=generator)
    return cache, table, torch.tensor(rows), torch.tensor(positions), q


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (None, 30.0), (5, 20.0)])
def test_kernel_matches_float64_reference(isa, kv_dtype, shape, window, softcap):
    contexts = CONTEXTS if window != 5 else [1, 4, 6, 17, 40]
    cache, table, table_row, positions, q = _paged_case(shape, kv_dtype, contexts, window, seed=sum(shape))
    scale = shape[2] ** -0.5
    out = torch.full_like(q, float("nan"))
    token_index = torch.arange(q.shape[0])
    cpu_kernels.paged_attention_cpu(q, cache, out, token_index, positions, table, table_row, window, scale, softcap,
                                    isa)
    expected = _reference(q, cache, table, table_row, positions, window, scale, softcap)
    # Float32 math over the stored values: the reference reads the same stored values.
    torch.testing.assert_close(out.double(), expected, atol=3e-6, rtol=3e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(8, 1, 64), (4, 2, 16), (4, 2, 12)], ids=str)
@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_float64_reference(isa, kv_dtype, shape, window):
    """gpt-oss's attention sinks: per query head, a logit in the softmax's denominator (not scaled,
    not soft-capped), some below every score, some above (most of the weight on the sink), on
    every path. Tolerance as test_kernel_matches_float64_reference's: the same float32 math
    over the same stored values, the sink one more term of each denominator (one rounding)."""
    contexts = [1, 4, 6, 17, 40] if window else CONTEXTS
    cache, table, table_row, positions, q = _paged_case(shape, kv_dtype, contexts, window, seed=7 + sum(shape))
    scale = shape[2] ** -0.5
    sinks = torch.linspace(-6.0, 6.0, shape[0])
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_attention_cpu(q, cache, out, torch.arange(q.shape[0]), positions, table, table_row, window,
                                    scale, None, isa, sinks=sinks)
    expected = _reference(q, cache, table, table_row, positions, window, scale, None, sinks)
    without = _reference(q, cache, table, table_row, positions, window, scale, None)
    assert (expected - without).abs().max() > 0.1  # the sinks move the output: the test tells them apart
    torch.testing.assert_close(out.double(), expected, atol=3e-6, rtol=3e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2])
def test_strided_queries_bfloat16_activations_and_threads(isa, threads, monkeypatch):
    """q/out rows as views of a wider tensor (the QKV projection), bfloat16 q/out over a
    float16 cache, several threads sharing the items: the same as the float64 reference
    to bfloat16's rounding."""
    monkeypatch.setattr(cpu_kernels, "_threads", lambda: threads)
    cache, table, table_row, positions, q = _paged_case((9, 3, 64), torch.float16, [300, 129, 2], None, seed=4)
    wide = torch.randn(q.shape[0], 15, 64).to(torch.bfloat16)
    wide[:, 3:12] = q.to(torch.bfloat16)
    q_view = wide[:, 3:12]
    out = torch.zeros(q.shape[0], 20, 64, dtype=torch.bfloat16)[:, 5:14]
    cpu_kernels.paged_attention_cpu(q_view, cache, out, torch.arange(q.shape[0]), positions, table, table_row, None,
                                    0.125, None, isa)
    expected = _reference(q_view.float(), cache, table, table_row, positions, None, 0.125, None)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


def _special_values() -> torch.Tensor:
    """Values that test a conversion's rounding: halfway cases, subnormals of float16,
    overflow past its range, signed zeros, infinities and NaN."""
    f16_ulp_at_1 = 2.0 ** -10
    values = [0.0, -0.0, 1.0, 1.0 + f16_ulp_at_1 / 2, 1.0 + 3 * f16_ulp_at_1 / 2, -1.0 - f16_ulp_at_1 / 2,
              65504.0, 65519.0, 65520.0, 1e6, -1e6, 2.0 ** -14, 2.0 ** -15, 2.0 ** -24, 2.0 ** -25,
              3 * 2.0 ** -26, 2.0 ** -26, 1e-10, math.inf, -math.inf, math.nan, 1.0 + 2.0 ** -8,
              1.0 + 3 * 2.0 ** -8, 3.1415926]
    return torch.tensor(values + torch.randn(256, generator=torch.Generator().manual_seed(0)).mul(100).tolist())


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_store_kv_rounds_as_torch_does(cache_dtype):
    values = _special_values()
    d = 8
    rows = values.numel() // d
    k = values[:rows * d].view(rows, 1, d)
    v = -k
    cache = torch.zeros(2, 1, rows, 1, d, dtype=cache_dtype)
    slots = torch.arange(rows).flip(0).contiguous()
    cpu_kernels.store_kv(k, v, cache, slots, None)
    expected_k = k.to(cache_dtype)[:, 0]
    got_k = cache[0, 0, slots, 0]
    assert torch.equal(got_k.isnan(), expected_k.isnan())
    finite = ~expected_k.isnan()
    assert torch.equal(got_k[finite].view(torch.int16), expected_k[finite].view(torch.int16))
    assert torch.equal(cache[1, 0, slots, 0][finite].view(torch.int16), (-k).to(cache_dtype)[:, 0][finite]
                       .view(torch.int16))

