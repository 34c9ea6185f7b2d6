"""BlockPool builders from the seed patch's deferred-free tests, shared by the
KV-level (tests/kv_cache) and scheduler-level (tests/scheduler) halves, and the
oracle of a state group's slots per step."""
from __future__ import annotations

from math import lcm

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.kv_cache.utils import BlockHashWithGroupId


def make_pool_with_cached_blocks(num_blocks: int, block_size: int = 16):
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


def eviction_order(pool: BlockPool) -> list[int]:
    """Drain the pool's free queue, returning block ids in eviction order
    (first returned == evicted first)."""
    order = []
    while pool.get_num_free_blocks() > 0:
        order.append(pool.get_new_blocks(1)[0].block_id)
    return order


def make_two_group_kv_cache_manager(num_blocks: int, block_size: int = 16) -> KVCacheManager:
    """Build a KVCacheManager with two single-type managers (a hybrid
    full-attention + sliding-window config), so CoW copies can be queued on
    more than one group."""
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


def state_step_slots(block_size: int, start: int, num_tokens: int,
                     table: list[int]) -> tuple[int | None, list[tuple[int, int]]]:
    """A state group's slots for a step of `num_tokens` tokens after `start` computed
    ones, re-derived here as the oracle: the slot read (None from a fresh start) and
    the (prefix length, slot) writes: every held boundary block crossed, and the
    running state's block at the step's end."""
    end = start + num_tokens
    read = table[(start - 1) // block_size] if start else None
    writes = [(length, table[length // block_size - 1]) for length in range(start + 1, end)
              if length % block_size == 0 and table[length // block_size - 1] != 0]
    return read, writes + [(end, table[(end - 1) // block_size])]
