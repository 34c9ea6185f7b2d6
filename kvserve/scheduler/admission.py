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
    """The longest sequence (at most `limit`) whose blocks fit in an otherwise empty pool."""
    num_usable_blocks = kv_cache_config.num_blocks - 1  # block 0 is the null block

    def fits(num_tokens: int) -> bool:
        return sum(num_blocks_for_tokens(group.kv_cache_spec, num_tokens, max_chunk_tokens)
                   for group in kv_cache_config.kv_cache_groups) <= num_usable_blocks

    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
