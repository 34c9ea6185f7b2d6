"""One block-table manager per KV-cache spec type (one instance per group).

Partial-block hits with copy-on-write (full attention only), the rule:
  * A group of block size B hashes at H = `hash_block_size` (H divides B). Every
    cached block carries a key at each H boundary it holds (see `block_pool`).
  * Lookup scans whole blocks from block 0 while their full key hits and the
    block ends at or before the hit limit `max_length` (num_tokens - 1: the
    last prompt token is always computed). At the first block that cannot be
    taken whole (a miss, or it would pass the limit), it probes that block's
    interior boundaries from the highest allowed (<= max_length) down to H; the
    first key found whose content is already computed (not cached during the
    current step: the copy runs before this step's forward pass) ends the hit
    inside the block. The hit length counts those copied tokens.
  * Such a block is never shared: on allocation the request gets a fresh block
    in its place, `(source, cow)` goes to `_pending_cow_copies` and both stay
    referenced (source: the hit's touch; cow: one extra) until the scheduler
    releases the pair after the step that performs the copy.
  * The request's private copy is re-cached (from its block start) once the
    request's own caching reaches it.
With H == B no interior keys exist and hits are block-aligned, as in vLLM.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

from kvserve.kv_cache.block_pool import BlockPool
from kvserve.kv_cache.interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    cdiv,
)
from kvserve.kv_cache.utils import BlockHash, KVCacheBlock, make_block_hash_with_group_id


class SingleTypeKVCacheManager(ABC):
    """The block tables of one KV-cache group: `req_to_blocks[request_id]` in
    allocation order, and how many leading blocks are registered in the cache."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 enable_caching: bool) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching and kv_cache_spec.prefix_cacheable
        self.null_block = block_pool.null_block
        self._group_id_bytes = make_block_hash_with_group_id(BlockHash(b""), kv_cache_group_id)
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        # (source, cow) pairs whose copy has not been handed to the runner yet.
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._cow_num_tokens: dict[int, int] = {}
        # request id -> (table index of the hit tail block, hit tokens inside it)
        self._partial_hit_reqs: dict[str, tuple[int, int]] = {}
        # Cached blocks adopted by prefix hits so far (null placeholders not counted).
        self.num_hit_blocks = 0

    @property
    def supports_partial_hits(self) -> bool:
        """Whether hits may end inside a block (copy-on-write)."""
        return False

    # ------------------------------------------------------------ lookup

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int,
                               alignment: int) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the longest hit of at most `max_length` tokens whose
        length is a multiple of `alignment` (or a CoW partial hit when
        `alignment` is the hash block size), and that length. No side effects."""

    def _lookup(self, block_hashes: list[BlockHash], num_tokens: int) -> KVCacheBlock | None:
        pool = self.block_pool
        # Inlined make_block_hash_with_group_id: this is the prefix-hit hot path.
        key = block_hashes[num_tokens // pool.hash_block_size - 1] + self._group_id_bytes
        pool.num_cache_lookups += 1
        entry = pool.cached_block_hash_to_block.get(key)  # type: ignore[call-overload]
        if entry is None:
            return None
        pool.num_cache_hits += 1
        return entry if isinstance(entry, KVCacheBlock) else next(iter(entry.values()))

    # ------------------------------------------------------------ allocation

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no later token attends to (their blocks can be released)."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock], num_hit_tokens: int) -> int:
        """Free blocks this group takes to hold `num_tokens` slots (hits that must
        leave the free queue, CoW targets and fresh blocks)."""
        num_held = len(self.req_to_blocks[request_id]) if request_id in self.req_to_blocks else 0
        num_required = cdiv(num_tokens, self.block_size)
        num_new = max(num_required - num_held - len(new_computed_blocks), 0)
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null)
        num_cow = 1 if new_computed_blocks and num_hit_tokens % self.block_size else 0
        return num_new + num_revived + num_cow

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock],
                                 num_hit_tokens: int) -> None:
        """Adopt a new request's prefix hit: take a reference and start its table with it."""
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "hits can only be adopted on a request's first allocation"
            return
        self.block_pool.touch(new_computed_blocks)
        self.num_hit_blocks += sum(1 for block in new_computed_blocks if not block.is_null)
        self.req_to_blocks[request_id].extend(new_computed_blocks)
        num_full_hit_blocks = num_hit_tokens // self.block_size
        self.num_cached_block[request_id] = min(num_full_hit_blocks, len(new_computed_blocks))
        if new_computed_blocks and num_hit_tokens % self.block_size:
            self._partial_hit_reqs[request_id] = (num_full_hit_blocks, num_hit_tokens % self.block_size)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Replace a partial-hit tail by its CoW copy, then append enough fresh
        blocks to hold `num_tokens` slots; returns the appended blocks."""
        table = self.req_to_blocks[request_id]
        self.num_cached_block.setdefault(request_id, 0)
        partial_hit = self._partial_hit_reqs.pop(request_id, None)
        if partial_hit is not None:
            self._apply_cow(table, *partial_hit)
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        return new_blocks

    def _apply_cow(self, table: list[KVCacheBlock], tail_idx: int, num_tokens: int) -> None:
        source = table[tail_idx]
        cow = self.block_pool.get_new_blocks(1)[0]
        # The source keeps the hit's reference, now owned by the pending copy;
        # the copy takes one extra reference on `cow` besides the table's.
        cow.ref_cnt += 1
        table[tail_idx] = cow
        self._pending_cow_copies.append((source, cow))
        self._cow_num_tokens[cow.block_id] = num_tokens

    def take_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock, int]]:
        """Drain the pending copies as (source, cow, number of tokens to copy)."""
        pairs = [(source, cow, self._cow_num_tokens.pop(cow.block_id, self.block_size))
                 for source, cow in self._pending_cow_copies]
        self._pending_cow_copies.clear()
        return pairs

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Release blocks no future token attends to (none for full attention)."""

    # ------------------------------------------------------------ caching

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Register the keys of the request's blocks up to prefix length `num_tokens`."""
        if not self.enable_caching or request.request_id not in self.num_cached_block:
            return
        num_tokens = min(num_tokens, len(request.block_hashes) * self.block_pool.hash_block_size)
        table = self.req_to_blocks[request.request_id]
        num_cached = self.num_cached_block[request.request_id]
        num_full = min(num_tokens // self.block_size, len(table))
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(request, table, num_cached, num_full, self.block_size,
                                              self.kv_cache_group_id, self.supports_partial_hits)
            self.num_cached_block[request.request_id] = num_full
        self._cache_partial_tail(request, table, num_tokens, num_full)

    def _cache_partial_tail(self, request: Any, table: list[KVCacheBlock], num_tokens: int, num_full: int) -> None:
        pass

    # ------------------------------------------------------------ freeing

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks in allocation order, leading nulls dropped."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        first_real = 0
        while first_real < len(blocks) and blocks[first_real].is_null:
            first_real += 1
        return blocks[first_real:]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: tables grow with the sequence; hits are prefixes from block 0,
    possibly ending inside a block (copy-on-write)."""

    @property
    def supports_partial_hits(self) -> bool:
        return self.block_pool.hash_block_size < self.block_size

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int,
                               alignment: int) -> tuple[list[KVCacheBlock], int]:
        block_size = self.block_size
        hits: list[KVCacheBlock] = []
        for i in range(max_length // block_size):
            block = self._lookup(block_hashes, (i + 1) * block_size)
            if block is None:
                break
            hits.append(block)
        hit_length = len(hits) * block_size
        if alignment == self.block_pool.hash_block_size < block_size:
            return hits, hit_length + self._find_partial_tail(block_hashes, max_length, hits)
        hit_length -= hit_length % alignment
        return hits[:cdiv(hit_length, block_size)], hit_length

    def _find_partial_tail(self, block_hashes: list[BlockHash], max_length: int, hits: list[KVCacheBlock]) -> int:
        """Probe the interior boundaries of the first block not taken whole; append
        the block found (if any) and return the hit tokens inside it."""
        hash_block_size = self.block_pool.hash_block_size
        block_start = len(hits) * self.block_size
        max_units = min(self.block_size // hash_block_size - 1, (max_length - block_start) // hash_block_size)
        for num_units in range(max_units, 0, -1):
            num_tokens = block_start + num_units * hash_block_size
            block = self.block_pool.get_cached_block_for_copy(
                block_hashes[num_tokens // hash_block_size - 1], self.kv_cache_group_id, num_tokens)
            if block is not None:
                hits.append(block)
                return num_units * hash_block_size
        return 0

    def _cache_partial_tail(self, request: Any, table: list[KVCacheBlock], num_tokens: int, num_full: int) -> None:
        if (num_tokens % self.block_size >= self.block_pool.hash_block_size and num_full < len(table)
                and request.request_id not in self._partial_hit_reqs):
            self.block_pool.cache_partial_block(request, table[num_full], num_tokens, self.kv_cache_group_id,
                                                self.block_size)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: blocks wholly left of the window of processed
    tokens go back to the pool and show as the null block in the table."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 enable_caching: bool) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        self.sliding_window = kv_cache_spec.sliding_window

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int,
                               alignment: int) -> tuple[list[KVCacheBlock], int]:
        # The last cdiv(window - 1, B) blocks before the hit end must all be cached
        # (or the run must reach block 0); blocks left of them are never read.
        num_needed = cdiv(self.sliding_window - 1, self.block_size)
        max_blocks = max_length // self.block_size
        if num_needed == 0:
            return [self.null_block] * max_blocks, max_blocks * self.block_size
        blocks = [self.null_block] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self._lookup(block_hashes, (i + 1) * self.block_size)
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run == num_needed:
                return blocks[:i + run], (i + run) * self.block_size
        return blocks[:run], run * self.block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock],
                                 num_hit_tokens: int) -> None:
        num_skipped_blocks = self.get_num_skipped_tokens(num_hit_tokens) // self.block_size
        in_window = [self.null_block if i < num_skipped_blocks else block
                     for i, block in enumerate(new_computed_blocks)]
        super().save_new_computed_blocks(request_id, in_window, num_hit_tokens)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock], num_hit_tokens: int) -> int:
        num_skipped_blocks = self.get_num_skipped_tokens(num_hit_tokens) // self.block_size
        num_held = len(self.req_to_blocks[request_id]) if request_id in self.req_to_blocks else 0
        num_new = max(cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks), 0)
        num_revived = sum(1 for block in new_computed_blocks[num_skipped_blocks:]
                          if block.ref_cnt == 0 and not block.is_null)
        return num_new + num_revived

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        if request_id not in self.req_to_blocks:
            return
        table = self.req_to_blocks[request_id]
        num_skipped_blocks = min(self.get_num_skipped_tokens(num_processed_tokens) // self.block_size, len(table))
        released = []
        for i in range(num_skipped_blocks - 1, -1, -1):
            if table[i].is_null:
                break
            released.append(table[i])
            table[i] = self.null_block
        self.block_pool.free_blocks(released)


class CircularBufferManager(SingleTypeKVCacheManager):
    """A fixed ring of `spec.blocks_per_request` blocks per request, claimed on the
    first allocation and kept until the request is freed. Never cached, never hit:
    the ring holds no tokens a later request could reuse."""

    def __init__(self, kv_cache_spec: CircularBufferSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 enable_caching: bool) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching=False)
        self.blocks_per_request = kv_cache_spec.blocks_per_request

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int,
                               alignment: int) -> tuple[list[KVCacheBlock], int]:
        return [], 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock], num_hit_tokens: int) -> int:
        return 0 if self.req_to_blocks.get(request_id) else self.blocks_per_request

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        self.num_cached_block.setdefault(request_id, 0)
        if self.req_to_blocks.get(request_id):
            return []
        ring = self.block_pool.get_new_blocks(self.blocks_per_request)
        self.req_to_blocks[request_id].extend(ring)
        return ring


class StateManager(SingleTypeKVCacheManager):
    """Recurrent-state layers: block i of a request's table holds the state after
    its token (i + 1) * block_size, and the block of its last token the running
    state (read and updated in place by the next step while it stays in that block).

    * Footprint: a step allocates a block for each block-size boundary it crosses
      (the snapshots, when caching) and one for its running state (without
      caching, the boundary entries are the null block). Once the steps up to a
      boundary are processed its snapshot is registered in the prefix cache and
      every block before the one holding the processed running state is released
      (tail first, shown as the null block), so a request holds O(1) blocks
      beyond those its steps in flight write.
    * Hits: a state needs only the snapshot at the hit's end; the hit is the
      longest aligned boundary whose snapshot is cached. The request reads that
      block and writes its running state into a block of its own, so a cached
      snapshot is never written.
    * Registration waits for processing (unlike the attention groups, which
      register blocks when they allocate them): a request admitted in the same
      step must not read a snapshot a step in flight has not written yet.
    """

    def __init__(self, kv_cache_spec: StateSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 enable_caching: bool) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
        # Leading table entries already released (all null).
        self._num_released: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], max_length: int,
                               alignment: int) -> tuple[list[KVCacheBlock], int]:
        step = max(alignment, self.block_size)
        end = max_length - max_length % step
        while end > 0:
            block = self._lookup(block_hashes, end)
            if block is not None:
                return [self.null_block] * (end // self.block_size - 1) + [block], end
            end -= step
        return [], 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock], num_hit_tokens: int) -> int:
        num_held = len(self.req_to_blocks[request_id]) if request_id in self.req_to_blocks else 0
        num_new = max(cdiv(num_tokens, self.block_size) - num_held - len(new_computed_blocks), 0)
        if not self.enable_caching:
            num_new = min(num_new, 1)
        num_revived = sum(1 for block in new_computed_blocks if block.ref_cnt == 0 and not block.is_null)
        return num_new + num_revived

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        table = self.req_to_blocks[request_id]
        self.num_cached_block.setdefault(request_id, 0)
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return []
        if self.enable_caching:
            new_blocks = self.block_pool.get_new_blocks(num_new)
        else:
            new_blocks = [self.null_block] * (num_new - 1) + self.block_pool.get_new_blocks(1)
        table.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, request_id: str, num_processed_tokens: int) -> None:
        """Release every block before the one holding the state after the processed
        tokens: no step in flight reads or writes them (steps start at or after
        the processed tokens and write only later boundaries)."""
        table = self.req_to_blocks.get(request_id)
        if not table:
            return
        keep_from = min(max(cdiv(num_processed_tokens, self.block_size) - 1, 0), len(table))
        num_released = self._num_released.get(request_id, 0)
        if keep_from <= num_released:
            return
        released = [table[i] for i in range(keep_from - 1, num_released - 1, -1) if not table[i].is_null]
        table[num_released:keep_from] = [self.null_block] * (keep_from - num_released)
        self._num_released[request_id] = keep_from
        self.block_pool.free_blocks(released)

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        """Register the snapshots of processed boundaries only (see the class docstring)."""
        num_processed = request.num_computed_tokens - request.num_in_flight_tokens
        super().cache_blocks(request, min(num_tokens, num_processed))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; its real blocks in allocation order (every null dropped)."""
        self._num_released.pop(request_id, None)
        return [block for block in super().pop_blocks_for_free(request_id) if not block.is_null]


_MANAGER_BY_SPEC_TYPE: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    CircularBufferSpec: CircularBufferManager,
    StateSpec: StateManager,
}


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int,
                                  enable_caching: bool) -> SingleTypeKVCacheManager:
    """The manager class that serves `kv_cache_spec`'s type."""
    for spec_type in type(kv_cache_spec).__mro__:
        if spec_type in _MANAGER_BY_SPEC_TYPE:
            return _MANAGER_BY_SPEC_TYPE[spec_type](kv_cache_spec, block_pool, kv_cache_group_id, enable_caching)
    raise TypeError(f"no KV-cache manager for {type(kv_cache_spec).__name__}")
