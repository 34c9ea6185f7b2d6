"""The block pool: every KV-cache block, the free queue and the prefix-cache map.

Free-queue order is eviction order. `free_blocks` puts blocks that reach a
ref count of 0 back in the order given: unhashed ones at the head (reused
first, they are worth nothing), hashed ones at the tail (aged LRU, still
hittable until handed out). Handing out a hashed block evicts it.

Prefix-cache keys (`BlockHashWithGroupId`) are registered at every
`hash_block_size` (H) boundary a block holds: with H == block size that is one
key per full block; with H < block size a block also carries the keys of its
interior boundaries, which is what lets a prompt hit inside a block (a
copy-on-write hit, see `single_type_manager`). The longest key is the block's
primary hash (`block.block_hash`); the others live in a side table.

A split layout (`KVCacheConfig.num_state_blocks`, see `layout`) gives the state
groups a pool of their own, `state_pool`: its own ids (a state slot id), null
block, free queue and prefix-cache map. The main pool stays the one door for
what is pool-wide: `free_blocks` hands each block to the pool that owns it (each
pool keeps the given order), and `end_step`, `reset_prefix_cache`, `kv_events`
and `check_invariants` cover both.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from kvserve.kv_cache.events import KVEventRecorder
from kvserve.kv_cache.utils import (
    BlockHash,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

logger = logging.getLogger(__name__)


class BlockPool:
    """Owns blocks 0..num_gpu_blocks-1; block 0 is the null block (never free).

    Keeps true: a non-null block is in the free queue exactly when its ref count
    is 0; every key in the map points at blocks that carry it, and every key a
    block carries is in the map (`check_invariants`).
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 num_state_blocks: int = 0) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"a block pool needs >= 2 blocks (one is the null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # key -> the block, or {block_id: block} when several blocks hold the same
        # content (never deduplicated: block tables are append-only).
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        # Keys a block carries besides its primary hash (interior H boundaries).
        self._secondary_keys_by_block_id: dict[int, list[BlockHashWithGroupId]] = {}
        # block id -> fewest prefix tokens of a key registered this step: that
        # content is written by this step's forward pass, so it cannot be the
        # source of a copy that runs before it.
        self._num_tokens_cached_this_step: dict[int, int] = {}
        self.num_cache_lookups = 0
        self.num_cache_hits = 0
        self.num_evictions = 0
        # The state groups' own pool in a split layout (module docstring), else None.
        self.state_pool = (BlockPool(num_state_blocks, enable_caching, hash_block_size)
                           if num_state_blocks else None)
        self._kv_events: KVEventRecorder | None = None

    @property
    def kv_events(self) -> KVEventRecorder | None:
        """Set to a KVEventRecorder when KV events are published (see `events`); the state
        pool records into the same one."""
        return self._kv_events

    @kv_events.setter
    def kv_events(self, recorder: KVEventRecorder | None) -> None:
        self._kv_events = recorder
        if self.state_pool is not None:
            self.state_pool.kv_events = recorder

    def owns(self, block: KVCacheBlock) -> bool:
        """Whether `block` is one of this pool's own (not its state pool's)."""
        return block.block_id < len(self.blocks) and self.blocks[block.block_id] is block

    # ------------------------------------------------------------ lookup

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for `block_hash`, or None if any group misses."""
        found = []
        for group_id in kv_cache_group_ids:
            self.num_cache_lookups += 1
            entry = self.cached_block_hash_to_block.get(make_block_hash_with_group_id(block_hash, group_id))
            if entry is None:
                return None
            self.num_cache_hits += 1
            found.append(entry if isinstance(entry, KVCacheBlock) else next(iter(entry.values())))
        return found

    def get_cached_block_for_copy(self, block_hash: BlockHash, kv_cache_group_id: int,
                                  num_tokens: int) -> KVCacheBlock | None:
        """A block holding the prefix `block_hash` (`num_tokens` long) whose content is
        already computed, i.e. not registered during the current step."""
        self.num_cache_lookups += 1
        entry = self.cached_block_hash_to_block.get(make_block_hash_with_group_id(block_hash, kv_cache_group_id))
        if entry is None:
            return None
        candidates = (entry,) if isinstance(entry, KVCacheBlock) else entry.values()
        for block in candidates:
            fresh_from = self._num_tokens_cached_this_step.get(block.block_id)
            if fresh_from is None or num_tokens < fresh_from:
                self.num_cache_hits += 1
                return block
        return None

    # ------------------------------------------------------------ caching

    def cache_full_blocks(self, request: Any, blocks: Sequence[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                          with_interior_keys: bool = True) -> None:
        """Register the keys of blocks [num_cached_blocks, num_full_blocks) of a request's
        table, block i covering prefix tokens up to (i+1)*block_size. Without
        interior keys only the full-block key is registered (for groups whose
        hits are block-aligned anyway)."""
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        interior_span = 0 if with_interior_keys else block_size - self.hash_block_size
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if not block.is_null:
                self._register_keys(block, request, i * block_size + interior_span, (i + 1) * block_size,
                                    kv_cache_group_id)

    def cache_partial_block(self, request: Any, block: KVCacheBlock, num_tokens: int,
                            kv_cache_group_id: int, block_size: int) -> None:
        """Register the keys of a request's tail block up to prefix length `num_tokens`
        (rounded down to H); the block's tokens past that may still change."""
        if not self.enable_caching or block.is_null:
            return
        block_start = ((num_tokens - 1) // block_size) * block_size
        end = (num_tokens // self.hash_block_size) * self.hash_block_size
        self._register_keys(block, request, block_start, end, kv_cache_group_id)

    def _register_keys(self, block: KVCacheBlock, request: Any, block_start: int, end: int, group_id: int) -> None:
        hash_block_size = self.hash_block_size
        block_hashes = request.block_hashes
        start = max(block._block_hash_num_tokens or 0, block_start)
        num_tokens = start + hash_block_size
        while num_tokens <= end:
            key = make_block_hash_with_group_id(block_hashes[num_tokens // hash_block_size - 1], group_id)
            if block._block_hash is not None:
                self._secondary_keys_by_block_id.setdefault(block.block_id, []).append(block._block_hash)
                block.reset_hash()
            block.set_block_hash(key, num_tokens)
            if self._insert(key, block) and self.kv_events is not None:
                self._record_stored(request, num_tokens // hash_block_size - 1, group_id)
            self._num_tokens_cached_this_step.setdefault(block.block_id, num_tokens)
            num_tokens += hash_block_size

    def _record_stored(self, request: Any, unit: int, group_id: int) -> None:
        size = self.hash_block_size
        parent = request.block_hashes[unit - 1] if unit > 0 else None
        self.kv_events.stored(request.block_hashes[unit], parent,
                              request.all_token_ids[unit * size:(unit + 1) * size], size, group_id)

    def _insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> bool:
        """Map `key` to `block` too; True when the key is new to the map."""
        entry = self.cached_block_hash_to_block.get(key)
        if entry is None:
            self.cached_block_hash_to_block[key] = block
            return True
        if isinstance(entry, KVCacheBlock):
            self.cached_block_hash_to_block[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block
        return False

    def _remove(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        # A key set on a block directly (`set_block_hash`) may never have been
        # registered: there is nothing to remove then.
        entry = self.cached_block_hash_to_block.get(key)
        if entry is None:
            return
        if isinstance(entry, KVCacheBlock):
            if entry is block:
                del self.cached_block_hash_to_block[key]
                if self.kv_events is not None:
                    self.kv_events.removed(get_block_hash(key), get_group_id(key))
            return
        if entry.pop(block.block_id, None) is None:
            return
        if len(entry) == 1:
            self.cached_block_hash_to_block[key] = next(iter(entry.values()))

    def _evict(self, block: KVCacheBlock) -> None:
        key = block._block_hash
        assert key is not None
        self._remove(key, block)
        for secondary in self._secondary_keys_by_block_id.pop(block.block_id, ()):
            self._remove(secondary, block)
        self._num_tokens_cached_this_step.pop(block.block_id, None)
        block.reset_hash()
        self.num_evictions += 1

    def end_step(self) -> None:
        """Everything cached so far is computed by the time the next step's copies run."""
        self._num_tokens_cached_this_step.clear()
        if self.state_pool is not None:
            self.state_pool.end_step()

    # ------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the head of the free queue, ref count 1,
        evicting any prefix-cache keys they carried."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block._block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit), reviving free ones."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; the first block given is evicted first.

        Blocks reaching 0 go back in the given order: unhashed ones as a run at
        the head, hashed ones as a run at the tail. A state pool's blocks go to it,
        in the order given too.
        """
        if self.state_pool is not None:
            ordered_blocks = list(ordered_blocks)
            self.state_pool.free_blocks([block for block in ordered_blocks
                                         if not block.is_null and not self.owns(block)])
            ordered_blocks = [block for block in ordered_blocks if block.is_null or self.owns(block)]
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (hashed if block._block_hash is not None else unhashed).append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than held")
        self.free_block_queue.prepend_n(unhashed)
        self.free_block_queue.append_n(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache key. Refused (False, nothing changed) while any
        block other than the null block is held (in either pool)."""
        num_used = sum(pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks for pool in self.pools)
        if num_used > 0:
            logger.warning("cannot reset the prefix cache: %d blocks are still in use", num_used)
            return False
        for pool in self.pools:
            pool._forget_keys()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def _forget_keys(self) -> None:
        self.cached_block_hash_to_block.clear()
        self._secondary_keys_by_block_id.clear()
        self._num_tokens_cached_this_step.clear()
        for block in self.blocks:
            block.reset_hash()

    @property
    def pools(self) -> list[BlockPool]:
        """This pool, then its state pool if it has one."""
        return [self] if self.state_pool is None else [self, self.state_pool]

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable (non-null) blocks that are held."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_gpu_blocks - 1)

    # ------------------------------------------------------------ checking

    def check_invariants(self, expected_ref_cnts: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent.

        `expected_ref_cnts` (block id -> number of holders; absent means 0), when
        given, must match every non-null block's ref count exactly. A state pool is
        checked too (its ref counts against its own `check_invariants` call, if wanted).
        """
        if self.state_pool is not None:
            self.state_pool.check_invariants()
        _check(self.null_block is self.blocks[0] and self.null_block.is_null, "block 0 must be the null block")
        _check(self.null_block.prev_free_block is None and self.null_block.block_hash is None,
               "the null block is never free and never hashed")
        free_blocks = self.free_block_queue.get_all_free_blocks()
        _check(len(free_blocks) == self.free_block_queue.num_free_blocks,
               f"free list length {len(free_blocks)} != counter {self.free_block_queue.num_free_blocks}")
        free_ids = {block.block_id for block in free_blocks}
        _check(len(free_ids) == len(free_blocks), "a block appears twice in the free queue")
        for block in self.blocks[1:]:
            _check(block.ref_cnt >= 0, f"block {block.block_id} has a negative ref count")
            _check((block.ref_cnt == 0) == (block.block_id in free_ids),
                   f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: {block.block_id in free_ids}")
            if expected_ref_cnts is not None:
                expected = expected_ref_cnts.get(block.block_id, 0)
                _check(block.ref_cnt == expected, f"block {block.block_id}: ref_cnt {block.ref_cnt} != {expected} holders")
        self._check_hash_map()

    def _check_hash_map(self) -> None:
        num_keys = 0
        for block in self.blocks:
            keys = self._secondary_keys_by_block_id.get(block.block_id, [])
            _check(not keys or block.block_hash is not None, f"block {block.block_id} has keys but no primary hash")
            for key in keys + ([block.block_hash] if block.block_hash is not None else []):
                entry = self.cached_block_hash_to_block.get(key)
                holders = {entry.block_id: entry} if isinstance(entry, KVCacheBlock) else (entry or {})
                _check(holders.get(block.block_id) is block, f"block {block.block_id}'s key missing from the map")
                num_keys += 1
        num_entries = sum(1 if isinstance(entry, KVCacheBlock) else len(entry)
                          for entry in self.cached_block_hash_to_block.values())
        _check(num_entries == num_keys, f"the map holds {num_entries} entries, blocks carry {num_keys} keys")
        _check(self.enable_caching or num_keys == 0, "caching is off but blocks are hashed")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
