"""`KVCacheManager`: the scheduler's one door into the KV cache.

A request's slots, for one `allocate_slots` call (tokens left to right):

    |<- num_computed ->|<- new computed (hits) ->|<- new tokens ->|<- lookahead ->|
    |   already held   |   adopted from cache    |   allocated    |   allocated   |

Blocks covering `num_computed + new computed + new tokens` (capped at the
request's known tokens) are registered in the prefix cache right away, so a
request admitted later in the same step (an n > 1 sibling) hits them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from math import lcm
from typing import Any

from kvserve.kv_cache.coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from kvserve.kv_cache.interface import KVCacheConfig
from kvserve.kv_cache.layout import get_default_hash_block_size
from kvserve.kv_cache.utils import (
    KVCacheBlock,
    KVCacheBlockCopy,
    get_hash_fn_by_name,
    get_request_block_hasher,
)
from kvserve.request import Request

logger = logging.getLogger(__name__)


@dataclass
class KVCacheBlocks:
    """Blocks per KV-cache group: `blocks[g][j]` is block j of group g."""

    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(mine + theirs for mine, theirs in zip(self.blocks, other.blocks)))

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)

    def is_empty(self) -> bool:
        return not any(self.blocks)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the previous report, in requests and tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates, caches and frees the blocks of every request, across all groups.

    `hash_block_size` (default: the GCD of the cacheable groups' block sizes)
    must divide every cacheable group's block size; when it is smaller than a
    full-attention block size, prompts can hit inside a block (copy-on-write).
    """

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, scheduler_block_size: int | None = None,
                 hash_block_size: int | None = None, enable_caching: bool = True,
                 hash_algo: str = "sha256") -> None:
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ValueError("a KV-cache config needs at least one group")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.scheduler_block_size = scheduler_block_size or lcm(*(g.kv_cache_spec.block_size for g in groups))
        self.hash_block_size = hash_block_size or get_default_hash_block_size(kv_cache_config)
        for group in groups:
            spec = group.kv_cache_spec
            if spec.prefix_cacheable and spec.block_size % self.hash_block_size:
                raise ValueError(f"hash_block_size {self.hash_block_size} must divide block size {spec.block_size}")
        self.enable_caching = enable_caching and any(g.kv_cache_spec.prefix_cacheable for g in groups)
        self.coordinator: KVCacheCoordinator = get_kv_cache_coordinator(
            kv_cache_config, max_model_len, self.enable_caching, self.hash_block_size)
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple([] for _ in groups))
        # The hasher requests must be built with for their hashes to match this cache.
        self.request_block_hasher = get_request_block_hasher(self.hash_block_size, get_hash_fn_by_name(hash_algo))
        self._prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held: of the fuller pool when the state groups
        have a pool of their own (the one that runs out first holds requests back)."""
        return max(pool.get_usage() for pool in self.block_pool.pools)

    # ------------------------------------------------------------ lookup

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's longest prefix hit and its length in tokens. Never the whole
        prompt (the last token is computed to get logits), and none for a request that
        must compute its prompt (`Request.reads_prefix_cache`); changes nothing."""
        if not self.enable_caching or not request.reads_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        # Hashes cover complete hash units only; a request built without this
        # cache's hasher has none and can never hit.
        max_hit_length = min(request.num_tokens - 1, len(request.block_hashes) * self.hash_block_size)
        blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, max_hit_length)
        stats = self._prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return KVCacheBlocks(blocks), num_hit_tokens

    # ------------------------------------------------------------ allocation

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` (+ lookahead) after the computed tokens and
        the adopted hit (`new_computed_blocks`, `num_new_computed_tokens` long).

        Returns the newly appended blocks per group (a CoW copy replaces the hit
        tail in place: read whole tables with `get_block_ids`), or None when the
        pool is short, in which case nothing changed.
        """
        hit_blocks = (new_computed_blocks or self.empty_kv_cache_blocks).blocks
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = min(num_local_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        request_id = request.request_id
        # Count processed tokens only: an in-flight step still reads the window.
        num_processed = num_local_computed - request.num_in_flight_tokens
        if self.enable_caching:
            self.coordinator.cache_state_snapshots(request, num_processed)
        self.coordinator.remove_skipped_blocks(request_id, num_processed)
        if not self.coordinator.can_allocate(request_id, num_slots, hit_blocks, num_new_computed_tokens):
            return None
        if any(hit_blocks):
            self.coordinator.save_new_computed_blocks(request_id, hit_blocks, num_new_computed_tokens)
        new_blocks = self.coordinator.allocate_new_blocks(request_id, num_slots)
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_local_computed + num_new_tokens, request.num_tokens))
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks up to prefix length `num_computed_tokens`."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    # ------------------------------------------------------------ freeing

    def _cache_state_snapshots(self, request: Request) -> None:
        """Register the request's processed state snapshots before its blocks go (state
        groups register only what is processed, so the last step's would be lost)."""
        if self.enable_caching:
            self.coordinator.cache_state_snapshots(request, request.num_computed_tokens - request.num_in_flight_tokens)

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool now: per group, tail first."""
        self._cache_state_snapshots(request)
        self.coordinator.free(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request's blocks without freeing them; they come back in
        eviction order (each group reversed, groups concatenated), ready to be
        passed to `block_pool.free_blocks` as-is later."""
        self._cache_state_snapshots(request)
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Drain every group's pending CoW copies (group 0 first), once per step after
        scheduling. Returns the copies for the runner and the blocks they keep
        referenced, `[source, cow]` per copy, for the caller to free once the step
        that performs them is processed."""
        copies: list[KVCacheBlockCopy] = []
        retained: list[KVCacheBlock] = []
        for group_id, manager in enumerate(self.coordinator.single_type_managers):
            for source, cow, num_tokens in manager.take_cow_copies():
                copies.append(KVCacheBlockCopy(group_id, source.block_id, cow.block_id, num_tokens))
                retained.extend((source, cow))
        self.block_pool.end_step()
        return copies, retained

    # ------------------------------------------------------------ queries

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block table, per group (nulls as id 0)."""
        return tuple([block.block_id for block in blocks] for blocks in self.coordinator.get_blocks(request_id))

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Lookups since the previous call."""
        stats, self._prefix_cache_stats = self._prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while any block is held."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._prefix_cache_stats.reset = True
        return True

    def new_request(self, request_id: str, prompt_token_ids: list[int], **kwargs: Any) -> Request:
        """A `Request` hashed the way this cache expects (convenience for tests and tools)."""
        return Request(request_id, prompt_token_ids, block_hasher=self.request_block_hasher, **kwargs)
