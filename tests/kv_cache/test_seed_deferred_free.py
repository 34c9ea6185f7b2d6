"""The seed patch's KV-level test (tests/v1/core/test_deferred_block_free.py),
ported with only the imports and the helpers' construction changed (kvserve
specs take a dtype name, so no torch is needed). The seed's scheduler-level
tests are in tests/scheduler/test_deferred_block_free.py; both files build
their pools with tests/helpers/kv_blocks.py."""
from helpers.kv_blocks import eviction_order, make_pool_with_cached_blocks


def test_deferred_free_matches_immediate_free_eviction_order():
    """Regression for the deferred-free path collapsing per-group eviction
    order for multi-group (hybrid) KV caches.

    Group A owns blocks [1, 2, 3] (allocation order) and group B owns
    [4, 5, 6]. The immediate-free path frees each group in its own
    reversed ``free_blocks`` call; the fixed deferred-free path must
    reproduce exactly that order, not a single flattened reversal.
    """
    group_a_alloc = [1, 2, 3]
    group_b_alloc = [4, 5, 6]

    # Immediate path: KVCacheCoordinator.free() -> one reversed free_blocks
    # call per single-type manager (group).
    pool_imm, by_id = make_pool_with_cached_blocks(6)
    for group in (group_a_alloc, group_b_alloc):
        pool_imm.free_blocks([by_id[i] for i in reversed(group)])
    immediate_order = eviction_order(pool_imm)

    # Fixed deferred path: groups are kept separate (each already reversed)
    # and freed in their own call on drain -- mirroring the immediate path.
    pool_fixed, by_id = make_pool_with_cached_blocks(6)
    ordered_groups = [list(reversed(group_a_alloc)), list(reversed(group_b_alloc))]
    for group in ordered_groups:
        pool_fixed.free_blocks([by_id[i] for i in group])
    fixed_order = eviction_order(pool_fixed)

    assert fixed_order == immediate_order == [3, 2, 1, 6, 5, 4]

    # The old (buggy) deferred path flattened both groups then reversed once,
    # which produces a different order. Guard against regressing back to it.
    pool_buggy, by_id = make_pool_with_cached_blocks(6)
    flattened = group_a_alloc + group_b_alloc
    pool_buggy.free_blocks([by_id[i] for i in reversed(flattened)])
    buggy_order = eviction_order(pool_buggy)
    assert buggy_order == [6, 5, 4, 3, 2, 1]
    assert buggy_order != immediate_order


def test_three_group_deferred_free_matches_immediate_free_eviction_order():
    """The seed's check on a three-group layout (full + sliding window + state):
    group C's blocks are a state group's snapshots and running state. Per-group
    reversal equals the immediate path; one whole-list reversal does not."""
    groups = [[1, 2, 3], [4, 5, 6], [7, 8]]

    pool_imm, by_id = make_pool_with_cached_blocks(8)
    for group in groups:
        pool_imm.free_blocks([by_id[i] for i in reversed(group)])
    immediate_order = eviction_order(pool_imm)

    pool_fixed, by_id = make_pool_with_cached_blocks(8)
    pool_fixed.free_blocks([by_id[i] for group in groups for i in reversed(group)])
    assert eviction_order(pool_fixed) == immediate_order == [3, 2, 1, 6, 5, 4, 8, 7]

    pool_buggy, by_id = make_pool_with_cached_blocks(8)
    pool_buggy.free_blocks([by_id[i] for i in reversed([i for group in groups for i in group])])
    assert eviction_order(pool_buggy) == [8, 7, 6, 5, 4, 3, 2, 1] != immediate_order
