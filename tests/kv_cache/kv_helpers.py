"""Builders shared by the KV-cache tests (imported as a plain module)."""
from __future__ import annotations

from kvserve.kv_cache.interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    StateSpec,
)
from kvserve.kv_cache.manager import KVCacheManager
from kvserve.request import Request


def full_spec(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def sliding_spec(block_size: int = 4, window: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32",
                             sliding_window=window)


def circular_spec(block_size: int = 4, window: int = 8) -> CircularBufferSpec:
    return CircularBufferSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32",
                              sliding_window=window)


def state_spec(block_size: int = 4) -> StateSpec:
    return StateSpec(block_size=block_size, shapes=((2,), (3, 2)), dtype="float32")


def make_manager(specs: list[KVCacheSpec] | None = None, num_blocks: int = 11, hash_block_size: int | None = None,
                 enable_caching: bool = True, max_model_len: int = 1024, num_state_blocks: int = 0,
                 **kwargs) -> KVCacheManager:
    """A manager over `specs`, one group each; `num_state_blocks` > 0 gives the state
    groups a pool of their own."""
    specs = specs or [full_spec()]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)],
                           num_state_blocks=num_state_blocks)
    return KVCacheManager(config, max_model_len=max_model_len, hash_block_size=hash_block_size,
                          enable_caching=enable_caching, **kwargs)


def make_request(manager: KVCacheManager, request_id: str, prompt: list[int], **kwargs) -> Request:
    return manager.new_request(request_id, prompt, **kwargs)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """Look the request up and allocate its whole remaining prompt (or
    `num_new_tokens`), as the scheduler's waiting loop does; returns
    (hit length, newly allocated blocks)."""
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit_tokens
    return num_hit_tokens, new_blocks


def complete_step(request: Request, num_tokens: int, output_token: int | None = None) -> None:
    """What the scheduler does once a step of `num_tokens` for `request` is processed."""
    request.num_computed_tokens += num_tokens
    if output_token is not None and request.num_computed_tokens >= request.num_tokens:
        request.append_output_token_ids(output_token)


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def free_queue_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def ref_cnts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def holder_counts(manager: KVCacheManager, retained=(), pool=None) -> dict[int, int]:
    """Block id -> references the bookkeeping says exist: table entries, pending
    CoW pairs (both ends) and blocks the caller still retains; only `pool`'s blocks
    when given (a split layout's pools reuse ids)."""
    counts: dict[int, int] = {}

    def hold(block) -> None:
        if not block.is_null and (pool is None or pool.owns(block)):
            counts[block.block_id] = counts.get(block.block_id, 0) + 1

    for type_manager in manager.coordinator.single_type_managers:
        for table in type_manager.req_to_blocks.values():
            for block in table:
                hold(block)
        for source, cow in type_manager._pending_cow_copies:
            hold(source)
            hold(cow)
    for block in retained:
        hold(block)
    return counts


def check(manager: KVCacheManager, retained=()) -> None:
    for pool in manager.block_pool.pools:
        pool.check_invariants(holder_counts(manager, retained, pool))

