"""KV-cache specs (one per attention kind, and recurrent states) and the cache layout config.

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


@dataclass(frozen=True)
class StateSpec(KVCacheSpec):
    """A recurrent layer's fixed-size state (Gated DeltaNet, Mamba-2): one slot per block id.

    `shapes` are the shapes of one layer's state tensors without the slot
    dimension (e.g. a conv state and a recurrent state), all of `dtype`.
    `block_size` is the number of prompt tokens between two state snapshots
    (equal to the attention groups' block size): the state after token
    (i + 1) * block_size of a request lives in block i of its table. A request
    keeps only its running state and the snapshots not yet handed to the
    prefix cache, so its footprint does not grow with its length.
    """

    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: Any = "float32"

    def __post_init__(self) -> None:
        if not self.shapes or any(not shape or min(shape) <= 0 for shape in self.shapes):
            raise ValueError(f"StateSpec needs non-empty positive shapes, got {self.shapes!r}")

    @property
    def slot_sizes(self) -> tuple[int, ...]:
        """Elements of one slot of each state tensor."""
        return tuple(_num_elements(shape) for shape in self.shapes)

    @property
    def page_size_bytes(self) -> int:
        return sum(self.slot_sizes) * dtype_size_bytes(self.dtype)


def _num_elements(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


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
    """The whole layout: how many blocks the pool holds and which groups use them.

    `num_state_blocks` > 0 gives the state groups (`StateSpec`) a pool of their own
    with that many blocks (its block 0 a null block too); with 0 every group draws
    from the one pool of `num_blocks` (a dense model, a state-only model, or a
    config built by hand). See `kvserve.kv_cache.layout`."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
    num_state_blocks: int = 0
