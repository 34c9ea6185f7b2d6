"""Prefix-cache hashing set-up: the hash unit and each request's block hasher."""
from __future__ import annotations

import math
from typing import Any, Callable

from kvserve.config import CacheConfig
from kvserve.kv_cache.interface import KVCacheConfig
from kvserve.kv_cache.utils import get_hash_fn_by_name, get_request_block_hasher
from kvserve.request import Request

BlockHasher = Callable[[Any], list[Any]]


def choose_hash_block_size(kv_cache_config: KVCacheConfig, cache_config: CacheConfig) -> int:
    """`CacheConfig.hash_block_size` when set, else the GCD of the block sizes of
    the prefix-cacheable groups (the block size itself for one group)."""
    if cache_config.hash_block_size is not None:
        return cache_config.hash_block_size
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    cacheable_sizes = [spec.block_size for spec in specs if spec.prefix_cacheable]
    return math.gcd(*(cacheable_sizes or [spec.block_size for spec in specs]))


def make_block_hasher(hash_block_size: int, cache_config: CacheConfig) -> BlockHasher:
    return get_request_block_hasher(hash_block_size, get_hash_fn_by_name(cache_config.prefix_caching_hash_algo))


def attach_block_hasher(request: Request, block_hasher: BlockHasher) -> None:
    """Give a request built without a hasher the scheduler's, and hash its prompt."""
    request._block_hasher = block_hasher
    request.update_block_hashes()
