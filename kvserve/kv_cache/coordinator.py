"""Coordinators: run one single-type manager per KV-cache group over one shared pool.

Every group draws its blocks from the same `BlockPool` (the state groups from its
`state_pool` in a split layout, see `layout`); a block belongs to one group at a time. Hit lookup differs by variant:
  * no prefix caching: never a hit;
  * unitary (one group): that group's longest hit, which for full attention may
    end inside a block when `hash_block_size` < block size (CoW, see
    `single_type_manager`);
  * hybrid (several groups): the longest hit every group agrees on, found by
    shortening a candidate length until no group shortens it further. Sub-block
    (CoW) hits are allowed only when every group is full attention; otherwise
    hits are multiples of the scheduler block size (the LCM of the block
    sizes). A circular-buffer group holds no reusable tokens, so its layers
    could not attend to a hit prefix: any such group makes the hit 0. A state
    group serves a length when the snapshot at that boundary is cached, so the
    agreement lands on the longest boundary every group serves.
"""
from __future__ import annotations

from math import lcm
from typing import Any

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.interface import KVCacheConfig, KVCacheSpec, StateSpec
from kvserve.kv_cache.single_type_manager import (
    CircularBufferManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    StateManager,
    get_manager_for_kv_cache_spec,
)
from kvserve.kv_cache.utils import BlockHash, KVCacheBlock


class KVCacheCoordinator:
    """Fans every table operation out to the per-group managers, group 0 first."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool,
                 hash_block_size: int) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size,
                                    kv_cache_config.num_state_blocks)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self._pool_for(group.kv_cache_spec), group_id,
                                          enable_caching)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups))
        self._state_managers = [m for m in self.single_type_managers if isinstance(m, StateManager)]

    def _pool_for(self, spec: KVCacheSpec) -> BlockPool:
        state_pool = self.block_pool.state_pool
        return state_pool if state_pool is not None and isinstance(spec, StateSpec) else self.block_pool

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Per group, the blocks of the longest prefix hit; and its length in tokens."""
        return tuple([] for _ in self.single_type_managers), 0

    def can_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: tuple[list[KVCacheBlock], ...],
                     num_hit_tokens: int) -> bool:
        """Whether every pool has the free blocks its groups take for `num_tokens` slots."""
        required: dict[int, int] = {}
        for i, manager in enumerate(self.single_type_managers):
            num_blocks = manager.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i],
                                                            num_hit_tokens)
            required[id(manager.block_pool)] = required.get(id(manager.block_pool), 0) + num_blocks
        return all(required.get(id(pool), 0) <= pool.get_num_free_blocks() for pool in self.block_pool.pools)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[list[KVCacheBlock], ...],
                                 num_hit_tokens: int) -> None:
        # Every group takes its hits before any group allocates, so no group's
        # allocation can evict another group's hit.
        for i, manager in enumerate(self.single_type_managers):
            manager.save_new_computed_blocks(request_id, new_computed_blocks[i], num_hit_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        return tuple(manager.allocate_new_blocks(request_id, num_tokens) for manager in self.single_type_managers)

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_processed_tokens)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def cache_state_snapshots(self, request: Any, num_processed_tokens: int) -> None:
        """Register the state groups' snapshots up to the processed tokens: before
        `remove_skipped_blocks` releases them, and before a request's blocks are freed."""
        for manager in self._state_managers:
            manager.cache_blocks(request, min(num_processed_tokens, request.num_tokens))

    def free(self, request_id: str) -> None:
        """Free the request's blocks now, in the order `pop_blocks_for_free` gives.

        One `free_blocks` call over that list (not one call per group): unhashed
        blocks are prepended as one run per call, so per-group calls would put
        group 1's unhashed blocks ahead of group 0's, while the deferred path
        frees the popped list in one call. One call keeps both paths identical.
        """
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request without freeing; return its blocks in eviction order.

        Each group's blocks reversed, groups concatenated in order: passing the
        list to one `free_blocks` call yields exactly the order `free()` gives.
        """
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(reversed(manager.pop_blocks_for_free(request_id)))
        return blocks

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(manager.req_to_blocks.get(request_id, []) for manager in self.single_type_managers)


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: no lookups, nothing registered."""


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool,
                 hash_block_size: int) -> None:
        super().__init__(kv_cache_config, max_model_len, enable_caching, hash_block_size)
        manager = self.single_type_managers[0]
        self._alignment = hash_block_size if isinstance(manager, FullAttentionManager) else manager.block_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        blocks, hit_length = self.single_type_managers[0].find_longest_cache_hit(
            block_hashes, max_cache_hit_length, self._alignment)
        return (blocks,), hit_length


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV-cache groups: the hit is the longest every group agrees on."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool,
                 hash_block_size: int) -> None:
        super().__init__(kv_cache_config, max_model_len, enable_caching, hash_block_size)
        managers = self.single_type_managers
        self._has_circular_group = any(isinstance(m, CircularBufferManager) for m in managers)
        if all(isinstance(m, FullAttentionManager) for m in managers):
            self._alignment = hash_block_size
        else:
            self._alignment = lcm(*(m.block_size for m in managers))

    def find_longest_cache_hit(self, block_hashes: list[BlockHash],
                               max_cache_hit_length: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        no_hit: tuple[list[KVCacheBlock], ...] = tuple([] for _ in self.single_type_managers)
        if self._has_circular_group:
            return no_hit, 0
        candidate = max_cache_hit_length
        while True:
            hits = [manager.find_longest_cache_hit(block_hashes, candidate, self._alignment)
                    for manager in self.single_type_managers]
            agreed = min(hit_length for _, hit_length in hits)
            if not self._allows_partial:
                agreed -= agreed % self._alignment
            if agreed == 0:
                return no_hit, 0
            if all(hit_length == agreed for _, hit_length in hits):
                return tuple(blocks for blocks, _ in hits), agreed
            candidate = agreed

    @property
    def _allows_partial(self) -> bool:
        return self._alignment == self.block_pool.hash_block_size


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool,
                             hash_block_size: int) -> KVCacheCoordinator:
    """The coordinator variant for this config."""
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, max_model_len, enable_caching, hash_block_size)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, max_model_len, enable_caching, hash_block_size)
    return HybridKVCacheCoordinator(kv_cache_config, max_model_len, enable_caching, hash_block_size)
