"""A point-in-time picture of the KV cache, read from the block pool itself.

Every block of the pool (the null block aside) is in exactly one state:
  * in use: held (ref count > 0) by a request table, a pending CoW copy or a
    deferred free that waits on an in-flight step;
  * cached: free, but still carrying a prefix-cache key, so a later prompt can
    hit it until the free queue hands it out (and evicts it);
  * free: free and empty.
So `num_blocks == blocks_in_use + blocks_cached + blocks_free` by construction.
Each group's entry carries the counts of the pool it draws from (the main pool,
or the state groups' own pool in a split layout) and adds what is its own
(blocks in its request tables, cached blocks keyed for it). Never holds token ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.interface import CircularBufferSpec, KVCacheSpec, SlidingWindowSpec, StateSpec
from kvserve.kv_cache.utils import get_group_id

DEFAULT_EVICTION_HEAD_LEN = 16


@dataclass(frozen=True)
class PoolBlockCounts:
    """The pool's usable blocks split by state (sums to `num_blocks`)."""

    num_blocks: int
    blocks_in_use: int
    blocks_cached: int
    blocks_free: int


@dataclass(frozen=True)
class EvictionQueueEntry:
    """One block at the head of the free queue: handed out (and evicted) first."""

    block_id: int
    hashed: bool
    group_id: int | None  # the group its prefix-cache key belongs to, when hashed


@dataclass(frozen=True)
class KVGroupSnapshot:
    """One KV-cache group: its spec, the counts of the pool it draws from, and its own share."""

    group_id: int
    kind: str
    block_size: int
    sliding_window: int | None
    num_layers: int
    pool: PoolBlockCounts
    blocks_in_tables: int
    blocks_cached_for_group: int
    hit_blocks: int = 0  # cached blocks adopted by prefix hits since start (a state group: snapshots restored)


@dataclass(frozen=True)
class KVCacheSnapshot:
    """The whole cache: the main pool's counts (and the state pool's, in a split
    layout), groups and the head of the main pool's eviction queue."""

    block_size: int
    hash_block_size: int
    enable_caching: bool
    pool: PoolBlockCounts
    groups: list[KVGroupSnapshot]
    eviction_queue_head: list[EvictionQueueEntry] = field(default_factory=list)
    num_evictions: int = 0  # both pools
    state_pool: PoolBlockCounts | None = None


def kv_cache_kind(spec: KVCacheSpec) -> str:
    """"full", "sliding_window", "circular_buffer" or "state" (recurrent layers)."""
    if isinstance(spec, StateSpec):
        return "state"
    if isinstance(spec, CircularBufferSpec):
        return "circular_buffer"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    return "full"


def count_pool_blocks(pool: BlockPool) -> tuple[PoolBlockCounts, dict[int, int]]:
    """The pool's counts and, per group id, its cached (free, hashed) blocks."""
    cached_by_group: dict[int, int] = {}
    num_cached = 0
    for block in pool.free_block_queue.iter_free_blocks():
        key = block.block_hash
        if key is not None:
            num_cached += 1
            group_id = get_group_id(key)
            cached_by_group[group_id] = cached_by_group.get(group_id, 0) + 1
    num_free = pool.get_num_free_blocks()
    num_usable = pool.num_gpu_blocks - 1
    counts = PoolBlockCounts(num_blocks=num_usable, blocks_in_use=num_usable - num_free,
                             blocks_cached=num_cached, blocks_free=num_free - num_cached)
    return counts, cached_by_group


def eviction_queue_head(pool: BlockPool, max_len: int = DEFAULT_EVICTION_HEAD_LEN) -> list[EvictionQueueEntry]:
    """The first `max_len` blocks of the free queue, next to be handed out first."""
    head = []
    for block in pool.free_block_queue.iter_free_blocks():
        if len(head) >= max_len:
            break
        key = block.block_hash
        head.append(EvictionQueueEntry(block.block_id, key is not None,
                                       None if key is None else get_group_id(key)))
    return head


def snapshot_kv_cache(manager, eviction_head_len: int = DEFAULT_EVICTION_HEAD_LEN) -> KVCacheSnapshot:
    """A `KVCacheSnapshot` of a `KVCacheManager`; call it from the thread that owns it."""
    pool = manager.block_pool
    counts_by_pool = {id(p): count_pool_blocks(p) for p in pool.pools}
    groups = []
    for group_id, (group, single) in enumerate(zip(manager.kv_cache_config.kv_cache_groups,
                                                   manager.coordinator.single_type_managers)):
        counts, cached_by_group = counts_by_pool[id(single.block_pool)]
        spec = group.kv_cache_spec
        held_ids = {block.block_id for blocks in single.req_to_blocks.values()
                    for block in blocks if not block.is_null}
        groups.append(KVGroupSnapshot(
            group_id=group_id, kind=kv_cache_kind(spec), block_size=spec.block_size,
            sliding_window=getattr(spec, "sliding_window", None), num_layers=len(group.layer_names),
            pool=counts, blocks_in_tables=len(held_ids),
            blocks_cached_for_group=cached_by_group.get(group_id, 0), hit_blocks=single.num_hit_blocks))
    state_pool = None if pool.state_pool is None else counts_by_pool[id(pool.state_pool)][0]
    return KVCacheSnapshot(
        block_size=manager.scheduler_block_size, hash_block_size=manager.hash_block_size,
        enable_caching=manager.enable_caching, pool=counts_by_pool[id(pool)][0], groups=groups,
        eviction_queue_head=eviction_queue_head(pool, eviction_head_len),
        num_evictions=sum(p.num_evictions for p in pool.pools), state_pool=state_pool)
