"""The paged attention backend against dense attention over the whole sequence,
plus KV allocation (shared buffers) and CoW block copies."""
from __future__ import annotations

import pytest
import torch

from kvserve.kv_cache.interface import (CircularBufferSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        KVCacheTensor, SlidingWindowSpec)
from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.native import cpu_kernels
from kvserve.model.attention import (AttentionMetadata, AttentionParams, CpuNativeAttentionBackend,
                                     TorchAttentionBackend, select_attention_backend)
from kvserve.model.attention import metadata as attention
from kvserve.worker.kv_tensors import allocate_kv_caches, copy_kv_blocks, kv_cache_shape

HQ, HKV, D, BS = 4, 2, 8, 4

needs_native = pytest.mark.skipif(cpu_kernels.load_library() is None,
                                  reason="the native CPU kernel could not be built (no C compiler?)")


def dense_attention(q, k, v, first_pos, scale, softcap, window):
    """q: [Lq, HQ, D] at positions first_pos.., k/v: [L, HKV, D] for positions 0..L-1."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window:
        allowed &= q_pos - k_pos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_attention(q, k, v, cache, md, window, scale, softcap, native=False):
    """One layer's attention through the torch or the native CPU backend."""
    backend = CpuNativeAttentionBackend() if native else TorchAttentionBackend()
    return backend.forward(q, k, v, cache, md, AttentionParams(scale, softcap, window))


def _spec(kind: str, window: int):
    common = dict(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=window)
    return CircularBufferSpec(**common, sliding_window=window)


# Steps of (tokens per request): chunked prefills, a 13-token chunk wider than the ring (3
# blocks = 12 slots), then decodes, mixed in one batch; then prompts of more than 16 tokens
# (the native prefill kernel's), fresh and after cached context, across blocks.
SCHEDULES = {"short": [[13, 2, 9], [10, 1, 5], [0, 1, 0], [0, 1, 0]],
             "long": [[20, 2, 17], [19, 1, 13], [1, 1, 0], [0, 1, 0]]}


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native)])
@pytest.mark.parametrize("kind,softcap", [("full", None), ("full", 20.0), ("sliding", None), ("circular", None),
                                          ("circular", 20.0)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_paged_attention_matches_dense(kind, softcap, native, schedule):
    """Chunked prefills and decodes; with `native`, queries of up to 16 tokens go to the C kernel,
    longer ones to the prefill kernel (circular groups keep the torch path)."""
    window = 6 if kind != "full" else None
    spec = _spec(kind, window or 1)
    generator = torch.Generator().manual_seed(0)
    lengths = [40, 5, 30]
    schedule = SCHEDULES[schedule]
    qs = [torch.randn(n, HQ, D, generator=generator) for n in lengths]
    ks = [torch.randn(n, HKV, D, generator=generator) for n in lengths]
    vs = [torch.randn(n, HKV, D, generator=generator) for n in lengths]
    num_blocks = 64
    cache = torch.zeros(kv_cache_shape(spec, num_blocks))
    free = torch.randperm(num_blocks - 1, generator=generator).add(1).tolist()  # scattered block ids
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    if kind == "circular":
        tables = [t[:spec.blocks_per_request] for t in tables]
    done = [0] * len(lengths)
    for step in schedule:
        rows = [i for i, n in enumerate(step) if n]
        query_lens = [step[i] for i in rows]
        seq_lens = [done[i] + step[i] for i in rows]
        width = max(len(tables[i]) for i in rows)
        block_table = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in rows])
        md = AttentionMetadata.build(spec, query_lens, seq_lens, block_table)
        q = torch.cat([qs[i][done[i]:done[i] + step[i]] for i in rows])
        k = torch.cat([ks[i][done[i]:done[i] + step[i]] for i in rows])
        v = torch.cat([vs[i][done[i]:done[i] + step[i]] for i in rows])
        plan = CpuNativeAttentionBackend().plan(md, cache, AttentionParams(0.3, softcap, window)) if native \
            else md.plan(BS, window)
        assert (plan.native is not None) == (native and kind != "circular" and min(query_lens) <= 16)
        assert (plan.prefill is not None) == (native and kind != "circular" and max(query_lens) > 16)
        out = paged_attention(q, k, v, cache, md, window, 0.3, softcap, native)
        offset = 0
        for i in rows:
            end = done[i] + step[i]
            expected = dense_attention(qs[i][done[i]:end], ks[i][:end], vs[i][:end], done[i], 0.3, softcap, window)
            torch.testing.assert_close(out[offset:offset + step[i]], expected, atol=1e-5, rtol=1e-5)
            offset += step[i]
            done[i] = end


def test_allocate_shares_buffers_and_copies_only_the_groups_layers():
    full, sliding = _spec("full", 1), _spec("sliding", 8)
    specs = {"a0": full, "a1": full, "b0": sliding}
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[
        KVCacheTensor(full.page_size_bytes * 8, ["a0", "b0"]), KVCacheTensor(full.page_size_bytes * 8, ["a1"])],
        kv_cache_groups=[KVCacheGroupSpec(["a0", "a1"], full), KVCacheGroupSpec(["b0"], sliding)])
    caches = allocate_kv_caches(config, specs)
    assert caches["a0"].shape == kv_cache_shape(full, 8) == (2, HKV, 8, BS, D)
    assert caches["a0"].data_ptr() == caches["b0"].data_ptr()
    assert caches["a1"].data_ptr() != caches["a0"].data_ptr()
    caches["a0"][:, :, 3] = 1.0
    caches["a1"][:, :, 3] = 2.0
    copy_kv_blocks(caches, config, [KVCacheBlockCopy(group_id=0, src_block_id=3, dst_block_id=5, num_tokens=2)])
    assert torch.all(caches["a0"][:, :, 5] == 1.0) and torch.all(caches["a1"][:, :, 5] == 2.0)
    caches["b0"][:, :, 6] = 7.0  # block 6 belongs to group 1 only (the shared buffer shows it in a0 too)
    copy_kv_blocks(caches, config, [KVCacheBlockCopy(group_id=1, src_block_id=6, dst_block_id=2, num_tokens=4)])
    assert torch.all(caches["b0"][:, :, 2] == 7.0) and torch.all(caches["a1"][:, :, 2] == 0.0)


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_decode_batch_of_mixed_lengths_split_into_sub_batches_matches_dense(kind, monkeypatch):
    """Decode rows of very different lengths go to several padded sub-batches."""
    monkeypatch.setattr(attention, "_MIN_SAVED_BLOCK_READS", 1)
    window = 9 if kind == "sliding" else None
    spec = _spec(kind, window or 1)
    generator = torch.Generator().manual_seed(1)
    lengths = [3, 61, 17, 90, 9, 44, 90, 2]
    num_blocks = 128
    cache = torch.zeros(kv_cache_shape(spec, num_blocks))
    free = torch.randperm(num_blocks - 1, generator=generator).add(1).tolist()
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    ks = [torch.randn(n, HKV, D, generator=generator) for n in lengths]
    vs = [torch.randn(n, HKV, D, generator=generator) for n in lengths]
    # Fill the cache with every token but the last (a prefill step), then decode the last.
    prefill = AttentionMetadata.build(spec, [n - 1 for n in lengths], [n - 1 for n in lengths],
                                      _padded_table(tables))
    q_prefill = torch.randn(sum(lengths) - len(lengths), HQ, D, generator=generator)
    paged_attention(q_prefill, torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), cache,
                    prefill, window, 0.3, None)
    md = AttentionMetadata.build(spec, [1] * len(lengths), lengths, _padded_table(tables))
    plan = md.plan(BS, window)
    assert 1 < len(plan.sub_batches) <= attention._MAX_DECODE_SUB_BATCHES
    q = torch.randn(len(lengths), HQ, D, generator=generator)
    out = paged_attention(q, torch.cat([k[-1:] for k in ks]), torch.cat([v[-1:] for v in vs]), cache, md,
                          window, 0.3, None)
    for i, n in enumerate(lengths):
        expected = dense_attention(q[i:i + 1], ks[i], vs[i], n - 1, 0.3, None, window)
        torch.testing.assert_close(out[i:i + 1], expected, atol=1e-5, rtol=1e-5)


def _padded_table(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def test_length_groups_cover_each_row_once_longest_first():
    from kvserve.model.attention.metadata import _MAX_DECODE_SUB_BATCHES, _length_groups
    blocks = torch.tensor([2, 70, 3, 65, 30, 1, 2, 33] * 8)
    rows = torch.arange(len(blocks)) + 100
    groups = _length_groups(rows, blocks)
    assert 1 < len(groups) <= _MAX_DECODE_SUB_BATCHES
    assert sorted(torch.cat(groups).tolist()) == rows.tolist()
    longest = [int(blocks[g - 100].max()) for g in groups]
    assert longest == sorted(longest, reverse=True)
    assert all(bool((g[1:] > g[:-1]).all()) for g in groups)  # batch order within a group
    # Nothing to gain: one group, the rows in their batch order (not sorted by length).
    small = torch.tensor([1, 3, 2, 3, 1])
    assert _length_groups(rows[:5], small)[0].tolist() == rows[:5].tolist()


@needs_native
@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 37)])
def test_native_kernel_matches_torch_path_at_model_shapes(dtype, window):
    """SmolLM2's attention shape (9 query heads on 3 KV heads of 64, block 16): the kernel's
    decode output equals the torch path's within the storage dtype's rounding."""
    hq, hkv, d, bs = 9, 3, 64, 16
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype)
    if window:
        spec = SlidingWindowSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype, sliding_window=window)
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(kv_cache_shape(spec, 96), generator=generator).to(dtype)
    assert isinstance(select_attention_backend("cpu", dtype, hq, hkv, d, native_kernels=True),
                      CpuNativeAttentionBackend)
    lengths = [1, 16, 17, 100, 250, 33]
    free = torch.randperm(95, generator=generator).add(1).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lengths]
    md = AttentionMetadata.build(spec, [1] * len(lengths), lengths, _padded_table(tables))
    q = torch.randn(len(lengths), hq, d, generator=generator).to(dtype)
    # k/v of this step: what the cache already holds at the last position (the write is a no-op).
    last = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lengths)])
    rows = cache.view(2, hkv, -1, d)
    k, v = rows[0][:, last].transpose(0, 1), rows[1][:, last].transpose(0, 1)
    expected = paged_attention(q, k, v, cache, md, window, 0.125, None)
    native_plan = md.plan(bs, window, True)
    assert native_plan.native is not None and not native_plan.sub_batches
    out = paged_attention(q, k, v, cache, md, window, 0.125, None, native=True)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@needs_native
def test_native_kernel_rejects_shapes_it_cannot_take():
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=512, dtype=torch.float32)
    cache = torch.zeros(kv_cache_shape(spec, 4))
    q = torch.zeros(1, HQ, 512)
    assert select_attention_backend("cpu", torch.float32, HQ, HKV, 512, native_kernels=True).name == "torch"
    assert select_attention_backend("cpu", torch.float32, HQ, HKV, D, native_kernels=False).name == "torch"
    assert select_attention_backend("cpu", torch.float64, HQ, HKV, D, native_kernels=True).name == "torch"
    index = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(cpu_kernels.KernelArgumentError, match="head size 512"):
        cpu_kernels.paged_attention_cpu(q, cache, torch.empty_like(q), index, index, torch.ones(1, 1, dtype=torch.int64),
                                        index, None, 1.0, None)
