"""`kv_cache.snapshot`: counts from the pool itself, per group, and the eviction-queue head."""
from __future__ import annotations

from helpers.kv_blocks import make_two_group_kv_cache_manager

from kvserve.kv_cache.interface import CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec
from kvserve.kv_cache.snapshot import kv_cache_kind, snapshot_kv_cache


def _sums(snapshot) -> None:
    pool = snapshot.pool
    assert pool.num_blocks == pool.blocks_in_use + pool.blocks_cached + pool.blocks_free
    for group in snapshot.groups:
        assert group.pool == pool


def test_snapshot_follows_allocate_cache_and_free_in_two_groups():
    manager = make_two_group_kv_cache_manager(num_blocks=33)
    fresh = snapshot_kv_cache(manager)
    _sums(fresh)
    assert (fresh.pool.num_blocks, fresh.pool.blocks_free) == (32, 32)
    assert [g.kind for g in fresh.groups] == ["full", "sliding_window"]
    assert fresh.groups[1].sliding_window is not None

    request = manager.new_request("r0", list(range(40)))
    assert manager.allocate_slots(request, 40) is not None
    held = snapshot_kv_cache(manager)
    _sums(held)
    # 40 tokens = 3 blocks of 16 in each of the two groups; 2 full blocks each are cached.
    assert held.pool.blocks_in_use == 6
    assert [g.blocks_in_tables for g in held.groups] == [3, 3]
    assert held.pool.blocks_cached == 0

    manager.free(request)
    freed = snapshot_kv_cache(manager)
    _sums(freed)
    assert freed.pool.blocks_in_use == 0
    assert freed.pool.blocks_cached == 4
    assert [g.blocks_cached_for_group for g in freed.groups] == [2, 2]
    head = freed.eviction_queue_head
    assert len(head) == 16
    # The two unhashed tail blocks are handed out first; hashed ones carry their group.
    assert [entry.hashed for entry in head[:2]] == [False, False]
    hashed_groups = {entry.group_id for entry in snapshot_kv_cache(manager, 40).eviction_queue_head if entry.hashed}
    assert hashed_groups == {0, 1}


def test_eviction_evicts_and_counts():
    manager = make_two_group_kv_cache_manager(num_blocks=9)
    first = manager.new_request("a", list(range(32)))
    manager.allocate_slots(first, 32)
    manager.free(first)
    assert snapshot_kv_cache(manager).pool.blocks_cached == 4
    second = manager.new_request("b", list(range(100, 164)))
    assert manager.allocate_slots(second, 64) is not None
    snapshot = snapshot_kv_cache(manager)
    _sums(snapshot)
    assert snapshot.pool.blocks_free == 0 and snapshot.pool.blocks_cached == 0
    assert snapshot.num_evictions == 4


def test_kind_names():
    spec = dict(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
    assert kv_cache_kind(FullAttentionSpec(**spec)) == "full"
    assert kv_cache_kind(SlidingWindowSpec(**spec, sliding_window=64)) == "sliding_window"
    assert kv_cache_kind(CircularBufferSpec(**spec, sliding_window=64)) == "circular_buffer"
