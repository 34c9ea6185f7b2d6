"""The tiled prefill attention kernel (csrc/attention/prefill_attention.c) called directly,
against a float64 reference computed from the cache as stored: every path this CPU runs,
float32, bfloat16 and float16 caches, GQA ratios (the tile's rows are several query heads),
head sizes the AVX-512 path does and does not take whole, fresh prompts and chunks after
cached context (prefix hits, chunked prefill) crossing block boundaries, several chunks in
one call, scattered blocks with holes (the null block and unused blocks hold NaN: reading
one would show), sliding windows and soft-capping.

The bound, derived from the kernel's float32 arithmetic (u = 2**-24, the unit roundoff):
- a score s_j = sum_d (q_d * scale) k_jd is off by at most (D + 1) u sum_d |q_d k_jd| scale
  (the rounding of q * scale, then D fused multiply-adds: Higham's gamma_D), and the
  difference s_j - max that the exponential takes by 2 u max|s| more; soft-capping adds
  3 u cap (tanhf within 2 ulp, the division and product) and does not enlarge an error
  (tanh's slope is at most 1). Call the largest of these over a token's keys `delta`.
- softmax weights of scores each off by at most delta are off by at most 2 delta relative
  (the shift cancels); the exponential itself adds eps_exp: the vector path's Taylor
  polynomial to r^6 on |r| <= ln2/2 leaves 0.347**7 / 7! / e**-0.347 < 3u, Horner's seven
  roundings 7u, the 2**n scaling none; expf is within 2u. eps_exp = 12 u.
- the running max may grow at each key tile of KEY_TILE = 64 keys: the weights of earlier
  tiles are then rescaled by a factor exp(old - new) the output and the sum share (its own
  error cancels between them) but not the later tiles' weights: eps_exp + 2u per tile.
- the weighted sum of n values and the sum of n weights are float32 sums of positive
  weights (gamma_n each, relative to sum_j p_j |v_jd|), then one division: (2n + 2) u.
So |out - ref| <= (2 delta + eps_exp + tiles (eps_exp + 2u) + (2n + 2) u) sum_j p_j |v_jd|,
plus the rounding of the output where it is stored in 16 bits.
Attention sinks (a logit per query head in each softmax's denominator only) are folded in after
the last tile as one more tile holding one key: o e^(m - M) / (l e^(m - M) + e^(sink - M)), M
the larger of the row's max m and the sink. The differences m - M and sink - M are rounded by at
most u (|m| + |sink|) <= u (max|s| + delta + |sink|): delta grows by 2 u |sink| (the max|s| part
is already in it); the rescale e^(m - M) is a tile's (eps_exp + 2u), the sink's weight one more
exponential and term of the sum (eps_exp, counted as one more key: n + 1), and p_j, now divided
by the larger sum, keeps its relative error.
"""
from __future__ import annotations

import pytest
import torch

from helpers.attention_reference import paged_reference
from kvserve.native import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(
    cpu_kernels.load_library() is None or not cpu_kernels.attention_isa_available(isa),
    reason=f"{isa} path does not run on this CPU")) for isa in ("avx512", "avx2", "portable")]
RUNNABLE_ISAS = [isa for isa in ("avx512", "avx2", "portable")
                 if cpu_kernels.load_library() is not None and cpu_kernels.attention_isa_available(isa)]
KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK = 16
KEY_TILE = 64
U = 2.0 ** -24
EPS_EXP = 12 * U
# (query heads, KV heads, head size): Llama-3.2-1B's, Qwen2.5-0.5B's (7 query heads a KV
# head), SmolLM2's, no GQA at head size 128, 8 on one, a head size the AVX-512 path does
# not take whole, and 32 query heads on one KV head (tiles of two tokens).
SHAPES = [(32, 8, 64), (14, 2, 64), (9, 3, 64), (4, 4, 128), (8, 1, 64), (6, 2, 24), (32, 1, 16)]
# (tokens before the chunk, chunk length) per request: a fresh prompt, chunks after cached
# context that start and end inside blocks, a one-token chunk, a chunk of exactly one block.
CHUNKS = [(0, 70), (37, 40), (5, 1), (16, 16), (130, 20)]


def _case(shape, kv_dtype, chunks, window, seed):
    """A cache holding every request's keys in scattered blocks (the rest NaN); under a
    window the blocks no token of the chunk reads are the null block in the table."""
    hq, hkv, d = shape
    generator = torch.Generator().manual_seed(seed)
    contexts = [before + length for before, length in chunks]
    blocks_needed = [-(-n // BLOCK) for n in contexts]
    num_blocks = sum(blocks_needed) + 8
    cache = torch.full((2, hkv, num_blocks, BLOCK, d), float("nan"))
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    table = torch.zeros(len(chunks), max(blocks_needed), dtype=torch.int64)
    for r, ((before, _), n) in enumerate(zip(chunks, contexts)):
        first_read = max(0, before - window + 1) // BLOCK if window else 0
        for i in range(blocks_needed[r]):
            block = free.pop()
            filled = min(BLOCK, n - i * BLOCK)
            cache[:, :, block, :filled] = torch.randn(2, hkv, filled, d, generator=generator)
            table[r, i] = block if i >= first_read else 0
    cache = cache.to(kv_dtype)
    lengths = torch.tensor([length for _, length in chunks])
    starts = torch.zeros_like(lengths)
    starts[1:] = lengths.cumsum(0)[:-1]
    q = torch.randn(int(lengths.sum()), hq, d, generator=generator)
    return cache, table, starts, lengths, torch.tensor([before for before, _ in chunks]), q


def _per_token(starts, lengths, first_pos):
    """Each token's request row and position, for the per-token reference."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(first_pos.tolist(), lengths.tolist())])
    return rows, positions


def derived_bound(abs_values, abs_products, abs_scores, positions, window, softcap, head_dim, sinks=None):
    """The module docstring's bound for each output element."""
    keys = positions + 1 if not window else torch.clamp(positions + 1, max=window)
    delta = (head_dim + 1) * U * abs_products + 2 * U * abs_scores + (3 * U * softcap if softcap else 0.0)
    tiles = (keys + KEY_TILE - 1) // KEY_TILE + 1  # a chunk's first key need not start a tile
    if sinks is not None:  # the sink: one more tile of one key, its differences rounded
        delta = delta + 2 * U * sinks.double().abs()
        keys, tiles = keys + 1, tiles + 1
    per_weight = 2 * delta + EPS_EXP + tiles[:, None] * (EPS_EXP + 2 * U) + (2 * keys[:, None] + 2) * U
    return per_weight[..., None] * abs_values


def _run(q, cache, table, starts, lengths, first_pos, window, softcap, isa, out=None, sinks=None):
    out = torch.full_like(q, float("nan")) if out is None else out
    cpu_kernels.prefill_attention_cpu(q, cache, out, starts, lengths, first_pos, torch.arange(len(lengths)), table,
                                      window, q.shape[-1] ** -0.5, softcap, isa, sinks=sinks)
    return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("window,softcap", [(None, None), (37, None), (None, 30.0), (5, 20.0)])
def test_kernel_matches_float64_reference(kv_dtype, shape, window, softcap):
    """Every path this CPU runs (one reference for all: it is the slow part)."""
    cache, table, starts, lengths, first_pos, q = _case(shape, kv_dtype, CHUNKS, window, seed=sum(shape))
    rows, positions = _per_token(starts, lengths, first_pos)
    expected, abs_values, abs_products, abs_scores = paged_reference(
        q, cache, table, rows, positions, window, shape[2] ** -0.5, softcap, weights=True)
    bound = derived_bound(abs_values, abs_products, abs_scores, positions, window, softcap, shape[2])
    stored = cache.clone()
    for isa in RUNNABLE_ISAS:
        out = _run(q, cache, table, starts, lengths, first_pos, window, softcap, isa)
        assert torch.equal(cache.view(torch.uint8), stored.view(torch.uint8))  # the cache is only read
        error = (out.double() - expected).abs()
        assert not out.isnan().any(), isa
        assert (error <= bound).all(), f"{isa}: worst error {float(error.max()):.3g}, " \
                                       f"excess {float((error - bound).max()):.3g}"


@pytest.mark.parametrize("shape", [(32, 8, 64), (8, 1, 64), (6, 2, 24)], ids=str)
@pytest.mark.parametrize("window", [None, 37])
def test_sinks_join_each_softmax_denominator(shape, window):
    """gpt-oss's attention sinks on every path this CPU runs: sinks below, among and far above
    the scores (one at 30: the sink takes nearly all the weight and sets the max; one at -30:
    none), within the derived bound of the float64 reference with the sinks in its softmax;
    the same outputs without the sinks fall outside it (the test sees them)."""
    cache, table, starts, lengths, first_pos, q = _case(shape, torch.bfloat16, CHUNKS, window, seed=sum(shape) + 1)
    sinks = torch.randn(shape[0], generator=torch.Generator().manual_seed(5)) * 2
    sinks[0], sinks[-1] = 30.0, -30.0
    rows, positions = _per_token(starts, lengths, first_pos)
    expected, abs_values, abs_products, abs_scores = paged_reference(
        q, cache, table, rows, positions, window, shape[2] ** -0.5, None, sinks=sinks, weights=True)
    bound = derived_bound(abs_values, abs_products, abs_scores, positions, window, None, shape[2], sinks=sinks)
    for isa in RUNNABLE_ISAS:
        out = _run(q, cache, table, starts, lengths, first_pos, window, None, isa, sinks=sinks)
        error = (out.double() - expected).abs()
        assert not out.isnan().any(), isa
        assert (error <= bound).all(), f"{isa}: worst error {float(error.max()):.3g}, " \
                                       f"excess {float((error - bound).max()):.3g}"
        without = _run(q, cache, table, starts, lengths, first_pos, window, None, isa)
        assert not ((without.double() - expected).abs() <= bound).all(), isa
    with pytest.raises(cpu_kernels.KernelArgumentError):  # one logit per query head
        _run(q, cache, table, starts, lengths, first_pos, window, None, RUNNABLE_ISAS[-1], sinks=sinks[1:])


@pytest.mark.parametrize("isa", ISAS)
def test_thread_count_does_not_change_a_bit(isa, monkeypatch):
    """Each tile is computed whole by one thread in a fixed order: 1 and 2 threads agree exactly."""
    cache, table, starts, lengths, first_pos, q = _case((32, 8, 64), torch.bfloat16, [(0, 300), (64, 200)], None, 3)
    results = []
    for threads in (1, 2):
        monkeypatch.setattr(cpu_kernels, "_threads", lambda: threads)
        results.append(_run(q, cache, table, starts, lengths, first_pos, None, None, isa))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("isa", ISAS)
def test_strided_bfloat16_queries_and_outputs(isa):
    """q/out as views of wider rows (the QKV projection's), bfloat16 in and out over a float16
    cache: the float32 result within its bound, then rounded to bfloat16 (half an ulp: 2**-8 relative)."""
    cache, table, starts, lengths, first_pos, q = _case((9, 3, 64), torch.float16, [(0, 70), (20, 50)], None, 4)
    wide = torch.randn(q.shape[0], 15, 64).to(torch.bfloat16)
    wide[:, 3:12] = q.to(torch.bfloat16)
    q_view = wide[:, 3:12]
    out_rows = torch.zeros(q.shape[0], 20, 64, dtype=torch.bfloat16)
    out = out_rows[:, 5:14]
    _run(q_view, cache, table, starts, lengths, first_pos, None, None, isa, out=out)
    rows, positions = _per_token(starts, lengths, first_pos)
    expected, abs_values, abs_products, abs_scores = paged_reference(
        q_view.float(), cache, table, rows, positions, None, 0.125, None, weights=True)
    bound = derived_bound(abs_values, abs_products, abs_scores, positions, None, None, 64)
    bound += (expected.abs() + bound) * 2 ** -8 + 2 ** -133  # bfloat16 rounding of the stored result
    assert ((out.double() - expected).abs() <= bound).all()
    assert not out_rows[:, :5].any() and not out_rows[:, 14:].any()  # nothing else written


def test_rejects_what_it_cannot_take():
    cache, table, starts, lengths, first_pos, q = _case((6, 4, 64), torch.float32, [(0, 4)], None, 0)
    with pytest.raises(cpu_kernels.KernelArgumentError):  # 6 query heads do not share 4 KV heads
        _run(q, cache, table, starts, lengths, first_pos, None, None, "portable")
