"""The seed patch's KV-level tests (tests/v1/core/test_deferred_block_free.py),
ported with only the imports and the helpers' construction changed (kvserve
specs take a dtype name, so no torch is needed)."""
from math import lcm

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.utils import BlockHashWithGroupId


def _make_pool_with_cached_blocks(num_blocks: int, block_size: int = 16):
    """Build a BlockPool holding `num_blocks` allocated, hashed blocks.

    Returns (pool, blocks_by_id). Each block gets a distinct hash so it is a
    prefix-cache eviction candidate once freed (blocks without a hash are
    always evicted first and would mask ordering).
    """
    pool = BlockPool(
        num_gpu_blocks=num_blocks + 1, enable_caching=True, hash_block_size=block_size
    )
    blocks = pool.get_new_blocks(num_blocks)
    for i, block in enumerate(blocks):
        block.set_block_hash(
            BlockHashWithGroupId(f"hash{i}".encode()), num_tokens=block_size
        )
    return pool, {b.block_id: b for b in blocks}


def _eviction_order(pool: BlockPool) -> list[int]:
    """Drain the pool's free queue, returning block ids in eviction order
    (first returned == evicted first)."""
    order = []
    while pool.get_num_free_blocks() > 0:
        order.append(pool.get_new_blocks(1)[0].block_id)
    return order


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
    pool_imm, by_id = _make_pool_with_cached_blocks(6)
    for group in (group_a_alloc, group_b_alloc):
        pool_imm.free_blocks([by_id[i] for i in reversed(group)])
    immediate_order = _eviction_order(pool_imm)

    # Fixed deferred path: groups are kept separate (each already reversed)
    # and freed in their own call on drain -- mirroring the immediate path.
    pool_fixed, by_id = _make_pool_with_cached_blocks(6)
    ordered_groups = [list(reversed(group_a_alloc)), list(reversed(group_b_alloc))]
    for group in ordered_groups:
        pool_fixed.free_blocks([by_id[i] for i in group])
    fixed_order = _eviction_order(pool_fixed)

    assert fixed_order == immediate_order == [3, 2, 1, 6, 5, 4]

    # The old (buggy) deferred path flattened both groups then reversed once,
    # which produces a different order. Guard against regressing back to it.
    pool_buggy, by_id = _make_pool_with_cached_blocks(6)
    flattened = group_a_alloc + group_b_alloc
    pool_buggy.free_blocks([by_id[i] for i in reversed(flattened)])
    buggy_order = _eviction_order(pool_buggy)
    assert buggy_order == [6, 5, 4, 3, 2, 1]
    assert buggy_order != immediate_order


def _make_two_group_kv_cache_manager(num_blocks: int, block_size: int = 16):
    """Build a KVCacheManager with two single-type managers (a hybrid
    full-attention + sliding-window config), so CoW copies can be queued on
    more than one group."""
    from kvserve.kv_cache.manager import KVCacheManager
    from kvserve.kv_cache.interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer1"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype="float32",
                ),
            ),
            KVCacheGroupSpec(
                ["layer2"],
                SlidingWindowSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype="float32",
                    sliding_window=2 * block_size,
                ),
            ),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=1024,
        scheduler_block_size=lcm(
            *(g.kv_cache_spec.block_size for g in config.kv_cache_groups)
        ),
        hash_block_size=block_size,
        enable_caching=True,
    )


def test_cow_retained_blocks_span_groups_and_free_order_is_stable_kv_part():
    """The KV half of the seed's
    ``test_cow_retained_blocks_span_groups_and_free_order_is_stable``: CoW
    retentions from multiple KV cache groups are concatenated into one flat
    list by ``take_kv_cache_block_copies``, group 0 first. (The scheduler half,
    immediate vs deferred ``_free_cow_retained_blocks``, lives in
    tests/scheduler.)"""
    manager = _make_two_group_kv_cache_manager(num_blocks=20)
    coordinator = manager.coordinator
    assert len(coordinator.single_type_managers) == 2

    # Queue a CoW (source, cow) pair on each of the two groups.
    blocks = manager.block_pool.get_new_blocks(4)
    coordinator.single_type_managers[0]._pending_cow_copies.append(
        (blocks[0], blocks[1])
    )
    coordinator.single_type_managers[1]._pending_cow_copies.append(
        (blocks[2], blocks[3])
    )

    _copies, retained = manager.take_kv_cache_block_copies()
    # Retentions from both groups are flattened into one list, group 0 first.
    assert [b.block_id for b in retained] == [b.block_id for b in blocks]
    assert [(c.group_id, c.src_block_id, c.dst_block_id) for c in _copies] == [
        (0, blocks[0].block_id, blocks[1].block_id),
        (1, blocks[2].block_id, blocks[3].block_id),
    ]
    # Drained: a second call hands back nothing.
    assert manager.take_kv_cache_block_copies() == ([], [])

    # Freed as-is (no reversal), the retained list's order is the eviction order
    # once the blocks carry hashes.
    retained_ids = [b.block_id for b in retained]
    pool, by_id = _make_pool_with_cached_blocks(len(retained_ids))
    pool.free_blocks([by_id[i] for i in retained_ids])
    assert _eviction_order(pool) == retained_ids
