"""How long a sequence the KV pool can hold for one request on its own.

A request that could not fit even with every other request preempted would
be preempted and readmitted forever; the scheduler refuses such prompts
(FINISHED_IGNORED) and caps generation at this length.
"""
from __future__ import annotations

from kvserve.kv_cache.interface import (
    CircularBufferSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
    cdiv,
)


def num_blocks_for_tokens(spec: KVCacheSpec, num_tokens: int, max_chunk_tokens: int) -> int:
    """An upper bound on the blocks one group holds for a request of `num_tokens`
    tokens scheduled in chunks of at most `max_chunk_tokens` (one step may be
    in flight, so the window lags by up to two chunks)."""
    if isinstance(spec, CircularBufferSpec):
        return spec.blocks_per_request
    full = cdiv(num_tokens, spec.block_size)
    if isinstance(spec, StateSpec):
        # The running state's block, the snapshots of the chunk in flight and of the
        # chunk being scheduled, and the block those chunks start from.
        return min(full, cdiv(2 * max_chunk_tokens, spec.block_size) + 2)
    if isinstance(spec, SlidingWindowSpec):
        in_window = cdiv(spec.sliding_window - 1 + 2 * max_chunk_tokens, spec.block_size) + 1
        return min(full, in_window)
    return full


def max_tokens_in_pool(kv_cache_config: KVCacheConfig, limit: int, max_chunk_tokens: int) -> int:
    """The longest sequence (at most `limit`) whose blocks fit in otherwise empty pools
    (the state groups' own pool too, when the layout gives them one)."""
    groups = kv_cache_config.kv_cache_groups
    pools = [(kv_cache_config.num_blocks, groups)]
    if kv_cache_config.num_state_blocks:
        pools = [(kv_cache_config.num_blocks, [g for g in groups if not isinstance(g.kv_cache_spec, StateSpec)]),
                 (kv_cache_config.num_state_blocks, [g for g in groups if isinstance(g.kv_cache_spec, StateSpec)])]

    def fits(num_tokens: int) -> bool:
        # Block 0 of each pool is its null block.
        return all(sum(num_blocks_for_tokens(group.kv_cache_spec, num_tokens, max_chunk_tokens)
                       for group in pool_groups) <= num_blocks - 1 for num_blocks, pool_groups in pools)

    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
