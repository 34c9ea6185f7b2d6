"""KVCacheManager with exact block ids (vLLM prefix-caching test style).

Block size 4 unless stated; a pool of 11 blocks has 10 usable ones (block 0
is the null block), handed out 1, 2, 3, ... when fresh.
"""
from kvserve.kv_cache.utils import KVCacheBlockCopy

from kv_helpers import (
    admit,
    check,
    circular_spec,
    complete_step,
    free_queue_ids,
    full_spec,
    ids,
    make_manager,
    make_request,
    ref_cnts,
    sliding_spec,
)


def test_hit_miss_and_ref_counts():
    manager = make_manager()
    r0 = make_request(manager, "0", list(range(10)))
    assert admit(manager, r0)[0] == 0
    assert manager.get_block_ids("0") == ([1, 2, 3],)
    # Full blocks are registered at allocation time; the partial tail is not.
    assert [b.block_hash is not None for b in manager.block_pool.blocks[1:4]] == [True, True, False]
    complete_step(r0, 10, output_token=100)

    r1 = make_request(manager, "1", list(range(8)) + [50, 51, 52])
    num_hit, new_blocks = admit(manager, r1)
    assert num_hit == 8 and new_blocks.get_block_ids() == ([4],)
    assert manager.get_block_ids("1") == ([1, 2, 4],)
    assert ref_cnts(manager, [1, 2, 3, 4]) == [2, 2, 1, 1]

    r2 = make_request(manager, "2", [7] * 5)
    assert admit(manager, r2) [0] == 0
    assert manager.get_block_ids("2") == ([5, 6],)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (3, 10 + 11 + 5, 8)
    assert manager.make_prefix_cache_stats().queries == 0
    check(manager)


def test_last_prompt_token_is_never_a_hit():
    manager = make_manager()
    r0 = make_request(manager, "0", list(range(8)))
    admit(manager, r0)
    complete_step(r0, 8)
    r1 = make_request(manager, "1", list(range(8)))
    blocks, num_hit = manager.get_computed_blocks(r1)
    assert num_hit == 4 and blocks.get_block_ids() == ([1],)
    assert admit(manager, r1)[1].get_block_ids() == ([3],)
    check(manager)


def test_get_computed_blocks_changes_nothing():
    manager = make_manager()
    r0 = make_request(manager, "0", list(range(9)))
    admit(manager, r0)
    manager.free(r0)
    before = (free_queue_ids(manager), ref_cnts(manager, list(range(11))))
    r1 = make_request(manager, "1", list(range(9)))
    assert manager.get_computed_blocks(r1)[1] == 8
    assert (free_queue_ids(manager), ref_cnts(manager, list(range(11)))) == before


def test_eviction_is_tail_first_and_lru_across_requests():
    manager = make_manager()
    prompt_a, prompt_b = list(range(8)), list(range(100, 108))
    ra, rb = make_request(manager, "a", prompt_a + [1]), make_request(manager, "b", prompt_b + [1])
    admit(manager, ra)
    admit(manager, rb)
    assert manager.get_block_ids("a") == ([1, 2, 3],) and manager.get_block_ids("b") == ([4, 5, 6],)
    manager.free(ra)
    manager.free(rb)
    # Unhashed tails (3, 6) are reused first; cached blocks age at the tail, A's before B's.
    assert free_queue_ids(manager) == [6, 3, 7, 8, 9, 10, 2, 1, 5, 4]
    big = make_request(manager, "big", list(range(200, 228)))  # 7 blocks
    admit(manager, big)
    assert manager.get_block_ids("big") == ([6, 3, 7, 8, 9, 10, 2],)
    # A lost its tail block only: its first block still hits; B is intact.
    assert manager.get_computed_blocks(make_request(manager, "a2", prompt_a + [5]))[1] == 4
    assert manager.get_computed_blocks(make_request(manager, "b2", prompt_b + [5]))[1] == 8
    check(manager)


def test_failed_allocation_changes_nothing():
    manager = make_manager(num_blocks=5)  # 4 usable
    r0 = make_request(manager, "0", list(range(12)))
    admit(manager, r0)
    r1 = make_request(manager, "1", list(range(4)) + [9] * 8)
    before = (free_queue_ids(manager), ref_cnts(manager, list(range(5))))
    num_hit, new_blocks = admit(manager, r1)
    assert num_hit == 4 and new_blocks is None
    assert (free_queue_ids(manager), ref_cnts(manager, list(range(5)))) == before
    assert "1" not in manager.coordinator.single_type_managers[0].req_to_blocks
    check(manager)


def test_reviving_free_cached_blocks_counts_against_the_free_pool():
    manager = make_manager(num_blocks=5)
    r0 = make_request(manager, "0", list(range(12)))
    admit(manager, r0)
    manager.free(r0)
    assert free_queue_ids(manager) == [4, 3, 2, 1]
    r1 = make_request(manager, "1", list(range(16)))
    num_hit, new_blocks = admit(manager, r1)
    assert num_hit == 12 and new_blocks.get_block_ids() == ([4],)
    assert manager.get_block_ids("1") == ([1, 2, 3, 4],)
    r2 = make_request(manager, "2", list(range(16)))
    assert admit(manager, r2)[1] is None  # its 3 hits are held; 1 more block needed, none free
    check(manager)


def test_decode_growth_lookahead_and_caching():
    manager = make_manager()
    r0 = make_request(manager, "0", list(range(4)))
    admit(manager, r0)
    complete_step(r0, 4, output_token=4)
    assert manager.allocate_slots(r0, 1, num_lookahead_tokens=3).get_block_ids() == ([2],)
    assert manager.allocate_slots(r0, 1, num_lookahead_tokens=4).get_block_ids() == ([3],)
    for token in range(5, 8):
        complete_step(r0, 1, output_token=token)
        manager.allocate_slots(r0, 1)
    # 8 known tokens: blocks 1 and 2 full and cached; lookahead slots are never cached.
    assert [manager.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, False]
    check(manager)


def test_caching_disabled():
    manager = make_manager(enable_caching=False)
    r0 = make_request(manager, "0", list(range(9)))
    admit(manager, r0)
    assert all(block.block_hash is None for block in manager.block_pool.blocks)
    assert manager.get_computed_blocks(make_request(manager, "1", list(range(9))))[1] == 0
    manager.free(r0)
    assert free_queue_ids(manager) == [3, 2, 1, 4, 5, 6, 7, 8, 9, 10]


def test_reset_prefix_cache():
    manager = make_manager()
    r0 = make_request(manager, "0", list(range(9)))
    admit(manager, r0)
    assert manager.reset_prefix_cache() is False
    assert manager.get_computed_blocks(make_request(manager, "1", list(range(9))))[1] == 8
    manager.free(r0)
    assert manager.reset_prefix_cache() is True
    assert manager.make_prefix_cache_stats().reset is True
    assert manager.get_computed_blocks(make_request(manager, "2", list(range(9))))[1] == 0
    assert all(block.block_hash is None for block in manager.block_pool.blocks)
    check(manager)


# ---------------------------------------------------------------- partial hits (CoW)

def test_partial_hit_inside_a_block_is_copied():
    manager = make_manager(hash_block_size=2)
    r0 = make_request(manager, "0", list(range(10)))
    admit(manager, r0)
    assert manager.take_kv_cache_block_copies() == ([], [])  # end of r0's step
    complete_step(r0, 10)

    r1 = make_request(manager, "1", list(range(7)) + [99, 98])
    num_hit, new_blocks = admit(manager, r1)
    assert num_hit == 6  # block 1 whole + 2 tokens of block 2
    assert new_blocks.get_block_ids() == ([5],)
    assert manager.get_block_ids("1") == ([1, 4, 5],)  # block 4 is r1's private copy of block 2
    check(manager)
    copies, retained = manager.take_kv_cache_block_copies()
    assert copies == [KVCacheBlockCopy(group_id=0, src_block_id=2, dst_block_id=4, num_tokens=2)]
    assert ids(retained) == [2, 4]
    assert ref_cnts(manager, [1, 2, 3, 4, 5]) == [2, 2, 1, 2, 1]
    check(manager, retained)
    manager.block_pool.free_blocks(retained)
    assert ref_cnts(manager, [2, 4]) == [1, 1]
    # The private copy is cached from its block start: tokens 4..7 of r1.
    assert manager.block_pool.blocks[4].block_hash_num_tokens == 8
    check(manager)


def test_partial_hit_from_the_last_token_rule_and_from_a_partial_block():
    manager = make_manager(hash_block_size=2)
    r0 = make_request(manager, "0", list(range(10)))
    admit(manager, r0)
    manager.take_kv_cache_block_copies()
    # Same 8 first tokens: the hit stops at 7 tokens, rounded down to 6, inside block 2.
    r1 = make_request(manager, "1", list(range(8)))
    assert admit(manager, r1)[0] == 6
    assert manager.get_block_ids("1") == ([1, 4],)
    # r0's tail block holds tokens 8, 9: a partial-block key at 10 tokens.
    assert manager.block_pool.blocks[3].block_hash_num_tokens == 10
    r2 = make_request(manager, "2", list(range(10)) + [77])
    assert admit(manager, r2)[0] == 10
    assert manager.get_block_ids("2") == ([1, 2, 5],)
    copies, retained = manager.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id, c.num_tokens) for c in copies] == [(2, 4, 2), (3, 5, 2)]
    assert ids(retained) == [2, 4, 3, 5]
    check(manager, retained)


def test_no_copy_from_content_cached_in_the_same_step():
    manager = make_manager(hash_block_size=2)
    r0 = make_request(manager, "0", list(range(10)))
    admit(manager, r0)
    # Same step: r0's blocks are registered but not computed before a copy would run.
    r1 = make_request(manager, "1", list(range(7)) + [99, 98])
    assert admit(manager, r1)[0] == 4  # the whole first block is shared, no copy
    assert manager.take_kv_cache_block_copies() == ([], [])
    r2 = make_request(manager, "2", list(range(7)) + [97, 96])
    assert admit(manager, r2)[0] == 6
    assert len(manager.take_kv_cache_block_copies()[0]) == 1


def test_block_aligned_hits_when_the_hash_unit_is_the_block():
    manager = make_manager()
    r0 = make_request(manager, "0", list(range(10)))
    admit(manager, r0)
    manager.take_kv_cache_block_copies()
    r1 = make_request(manager, "1", list(range(7)) + [99, 98])
    assert admit(manager, r1)[0] == 4
    assert manager.take_kv_cache_block_copies() == ([], [])


def test_partial_hits_in_two_full_attention_groups():
    manager = make_manager([full_spec(4), full_spec(8)], num_blocks=30, hash_block_size=2)
    r0 = make_request(manager, "0", list(range(12)))
    admit(manager, r0)
    assert manager.get_block_ids("0") == ([1, 2, 3], [4, 5])
    manager.take_kv_cache_block_copies()
    r1 = make_request(manager, "1", list(range(6)) + [50, 51, 52])
    assert admit(manager, r1)[0] == 6
    # Group 0 (block 4) copies 2 tokens of block 2; group 1 (block 8) 6 tokens of block 4.
    assert manager.get_block_ids("1") == ([1, 6, 7], [8, 9])
    copies, retained = manager.take_kv_cache_block_copies()
    assert [(c.group_id, c.src_block_id, c.dst_block_id, c.num_tokens) for c in copies] == [
        (0, 2, 6, 2), (1, 4, 8, 6)]
    assert ids(retained) == [2, 6, 4, 8]
    check(manager, retained)
    manager.block_pool.free_blocks(retained)
    manager.free(r0)
    manager.free(r1)
    check(manager)
    assert manager.block_pool.get_num_free_blocks() == 29


# ---------------------------------------------------------------- hybrid groups

def _hybrid_manager(num_blocks=21):
    return make_manager([full_spec(4), sliding_spec(4, window=8)], num_blocks=num_blocks)


def _run_prefill_then_decode(manager, request):
    admit(manager, request)
    complete_step(request, request.num_tokens, output_token=1000)
    return manager.allocate_slots(request, 1)


def test_sliding_window_releases_blocks_left_of_the_window():
    manager = _hybrid_manager()
    r0 = make_request(manager, "0", list(range(17)))
    admit(manager, r0)
    assert manager.get_block_ids("0") == ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    complete_step(r0, 17, output_token=1000)
    assert manager.allocate_slots(r0, 1).get_block_ids() == ([], [])
    # 17 processed tokens, window 8: tokens 0..9 are out of it, so blocks 0 and 1 go.
    assert manager.get_block_ids("0") == ([1, 2, 3, 4, 5], [0, 0, 8, 9, 10])
    # Released cached blocks age at the tail, highest position first.
    assert free_queue_ids(manager)[-2:] == [7, 6]
    check(manager)


def test_sliding_window_waits_for_in_flight_tokens():
    manager = make_manager([sliding_spec(4, window=8)])
    r0 = make_request(manager, "0", list(range(12)))
    admit(manager, r0)
    r0.num_computed_tokens, r0.num_in_flight_tokens = 12, 12  # step scheduled, not processed
    r0.append_output_token_ids(5)
    manager.allocate_slots(r0, 1)
    assert manager.get_block_ids("0") == ([1, 2, 3, 4],)
    r0.num_computed_tokens, r0.num_in_flight_tokens = 13, 1
    manager.allocate_slots(r0, 1)
    assert manager.get_block_ids("0") == ([0, 2, 3, 4],)
    check(manager)


def test_hybrid_full_and_sliding_window_hit():
    manager = _hybrid_manager()
    r0 = make_request(manager, "0", list(range(17)))
    _run_prefill_then_decode(manager, r0)
    r1 = make_request(manager, "1", list(range(17)) + [50, 51, 52])
    blocks, num_hit = manager.get_computed_blocks(r1)
    assert num_hit == 16
    assert blocks.get_block_ids() == ([1, 2, 3, 4], [0, 0, 8, 9])
    admit(manager, r1)
    assert manager.get_block_ids("1") == ([1, 2, 3, 4, 11], [0, 0, 8, 9, 12])
    check(manager)


def test_hybrid_hit_is_limited_by_the_sliding_window_group():
    manager = _hybrid_manager()
    r0 = make_request(manager, "0", list(range(17)))
    admit(manager, r0)
    swa = manager.coordinator.single_type_managers[1]
    # Evict the window group's block 3 (tokens 12..15) from the cache only.
    block = swa.req_to_blocks["0"][3]
    manager.block_pool._evict(block)
    r1 = make_request(manager, "1", list(range(17)) + [50])
    blocks, num_hit = manager.get_computed_blocks(r1)
    # Group 1 needs 2 cached blocks right before the hit end: [1, 2] -> 12 tokens.
    assert num_hit == 12
    assert blocks.get_block_ids() == ([1, 2, 3], [0, 7, 8])
    check(manager)


def test_pop_blocks_for_free_is_each_group_reversed_then_concatenated():
    freed_order = {}
    for path in ("free", "pop"):
        manager = _hybrid_manager()
        r0 = make_request(manager, "0", list(range(17)))
        _run_prefill_then_decode(manager, r0)
        if path == "free":
            manager.free(r0)
        else:
            popped = manager.pop_blocks_for_free(r0)
            assert ids(popped) == [5, 4, 3, 2, 1, 10, 9, 8]  # leading nulls dropped
            assert manager.get_block_ids("0") == ([], [])
            manager.block_pool.free_blocks(popped)
        freed_order[path] = free_queue_ids(manager)
        check(manager)
    assert freed_order["pop"] == freed_order["free"]
    # Unhashed tails first (group 0's, then group 1's), then each group's cached
    # blocks tail first, after the window blocks released earlier (7, 6).
    assert freed_order["free"] == [5, 10, *range(11, 21), 7, 6, 4, 3, 2, 1, 9, 8]


def test_circular_buffer_keeps_a_fixed_ring_and_never_hits():
    manager = make_manager([full_spec(4), circular_spec(4, window=8)], num_blocks=30)
    r0 = make_request(manager, "0", list(range(6)))
    admit(manager, r0)
    assert manager.get_block_ids("0") == ([1, 2], [3, 4, 5])
    complete_step(r0, 6, output_token=0)
    for token in range(1, 30):
        assert manager.allocate_slots(r0, 1) is not None
        complete_step(r0, 1, output_token=token)
    table_full, ring = manager.get_block_ids("0")
    assert len(table_full) == 9 and ring == [3, 4, 5]
    assert all(manager.block_pool.blocks[i].block_hash is None for i in ring)
    # The ring holds no reusable prefix: nothing hits, although group 0 is cached.
    r1 = make_request(manager, "1", list(range(6)) + [9])
    assert manager.get_computed_blocks(r1) == (manager.empty_kv_cache_blocks, 0)
    manager.free(r0)
    assert manager.block_pool.get_num_free_blocks() == 29
    check(manager)


def test_request_without_hashes_never_hits():
    from kvserve.request import Request

    manager = make_manager()
    r0 = make_request(manager, "0", list(range(9)))
    admit(manager, r0)
    unhashed = Request("1", list(range(9)))
    assert manager.get_computed_blocks(unhashed) == (manager.empty_kv_cache_blocks, 0)
    assert manager.allocate_slots(unhashed, 9).get_block_ids() == ([4, 5, 6],)
    assert all(manager.block_pool.blocks[i].block_hash is None for i in (4, 5, 6))
    check(manager)


def test_only_full_attention_blocks_carry_interior_keys():
    manager = make_manager([full_spec(4), sliding_spec(4, window=8)], num_blocks=21, hash_block_size=2)
    r0 = make_request(manager, "0", list(range(9)))
    admit(manager, r0)
    assert manager.get_block_ids("0") == ([1, 2, 3], [4, 5, 6])
    secondary = manager.block_pool._secondary_keys_by_block_id
    assert {block_id: len(keys) for block_id, keys in secondary.items()} == {1: 1, 2: 1}
    assert [manager.block_pool.blocks[i].block_hash_num_tokens for i in range(1, 7)] == [4, 8, None, 4, 8, None]
    # Mixed with a sliding window, hits stay block-aligned (no copies).
    r1 = make_request(manager, "1", list(range(7)) + [50, 51])
    assert manager.get_computed_blocks(r1)[1] == 4
    check(manager)
