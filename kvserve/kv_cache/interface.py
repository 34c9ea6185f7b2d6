"""KV-cache specs (one per attention kind) and the cache layout config.

Specs accept a torch dtype (or its name) without importing torch: only the
dtype's item size is read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_DTYPE_SIZES_BY_NAME = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


def dtype_size_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype, or of its name ("bfloat16")."""
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES_BY_NAME:
        raise ValueError(f"unknown KV-cache dtype {dtype!r}")
    return _DTYPE_SIZES_BY_NAME[name]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer needs from the KV cache, per block of `block_size` tokens."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def prefix_cacheable(self) -> bool:
        return True


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer's K and V pages: block_size x num_kv_heads x head_size each."""

    num_kv_heads: int
    head_size: int
    dtype: Any

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * dtype_size_bytes(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier token: the table grows with the sequence."""


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token attends to the last `sliding_window` tokens (itself included);
    blocks wholly outside the window are released and shown as the null block."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window <= 0:
            raise ValueError("SlidingWindowSpec needs sliding_window > 0")


@dataclass(frozen=True)
class CircularBufferSpec(AttentionSpec):
    """A windowed layer served from a fixed ring of blocks per request.

    Token at position p lives in ring block (p // block_size) % blocks_per_request,
    so the footprint is constant whatever the sequence length. Not prefix-cacheable.
    """

    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window <= 0:
            raise ValueError("CircularBufferSpec needs sliding_window > 0")

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def blocks_per_request(self) -> int:
        # One spare block so the block being written never holds in-window tokens.
        return cdiv(self.sliding_window, self.block_size) + 1


@dataclass
class KVCacheTensor:
    """One backing buffer of `size` bytes shared by the named layers."""

    size: int
    shared_by: list[str] = field(default_factory=list)


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table because they share one spec."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """The whole layout: how many blocks the pool holds and which groups use them."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
