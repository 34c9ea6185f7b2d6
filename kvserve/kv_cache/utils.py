"""Blocks, the free queue and block hashing.

A `KVCacheBlock` is one page of every layer tensor of one KV-cache group. The
`FreeKVCacheBlockQueue` threads the free blocks into an intrusive doubly linked
list: its head is handed out (and evicted from the prefix cache) first.

Block hashes are chained: hash i covers the parent hash i-1, the token ids of
hash unit i (`hash_block_size` tokens) and the unit's extra keys, so it
fingerprints the whole prefix `[0, (i+1) * H)`. The default function is sha256
over a canonical byte encoding, identical across processes.
"""
from __future__ import annotations

import hashlib
import os
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NewType, Sequence

BlockHash = NewType("BlockHash", bytes)
# Hash bytes followed by the 4-byte big-endian KV-cache group id.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)

HashFunction = Callable[[bytes], bytes]

_GROUP_ID_NUM_BYTES = 4


@dataclass(frozen=True)
class KVCacheBlockCopy:
    """Copy the first `num_tokens` token slots of one block into another, within one
    KV-cache group, before the forward pass that reads the destination (CoW)."""

    group_id: int
    src_block_id: int
    dst_block_id: int
    num_tokens: int


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One KV-cache page (per layer of its group) and its bookkeeping.

    `ref_cnt` counts the holders (request tables, pending CoW copies, deferred
    frees); a non-null block is in the free queue exactly when it is 0.
    `_block_hash_num_tokens` is the number of prefix tokens, from the request's
    first token, that the primary hash covers. Equality is identity.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    _block_hash_num_tokens: int | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: BlockHashWithGroupId, num_tokens: int | None = None) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"hashed_tokens={self._block_hash_num_tokens}, prev={prev_id}, next={next_id})")


class FreeKVCacheBlockQueue:
    """The free blocks as an intrusive doubly linked list between two sentinels.

    O(1) `popleft`, `append` and `remove` from the middle (a prefix hit revives
    a free cached block). The queue never reorders: callers decide placement.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._link_run(self._head, list(blocks), self._tail)

    @staticmethod
    def _link_run(before: KVCacheBlock, run: list[KVCacheBlock], after: KVCacheBlock) -> None:
        prev = before
        for block in run:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} free")
        popped: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            popped.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if blocks:
            last = self._tail.prev_free_block
            assert last is not None
            self._link_run(last, blocks, self._tail)
            self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the head, keeping their order (blocks[0] handed out first)."""
        if blocks:
            first = self._head.next_free_block
            assert first is not None
            self._link_run(self._head, blocks, first)
            self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self.iter_free_blocks())

    def iter_free_blocks(self) -> Iterator[KVCacheBlock]:
        """The free blocks in eviction order (head first), without copying; do not
        change the queue while iterating."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block


# ---------------------------------------------------------------- hashing

def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_NUM_BYTES, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return BlockHash(key[:-_GROUP_ID_NUM_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-_GROUP_ID_NUM_BYTES:], "big")


def sha256_hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def xxhash_hash(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("prefix_caching_hash_algo='xxhash' needs the `xxhash` package") from exc
    return xxhash.xxh3_128_digest(data)


def builtin_hash(data: bytes) -> bytes:
    # Python's hash is salted per process unless PYTHONHASHSEED is set: fast, process-local.
    return hash(data).to_bytes(8, "big", signed=True)


_HASH_FUNCTIONS: dict[str, HashFunction] = {
    "sha256": sha256_hash, "xxhash": xxhash_hash, "builtin": builtin_hash,
}


def get_hash_fn_by_name(name: str) -> HashFunction:
    """The hash function behind `CacheConfig.prefix_caching_hash_algo`."""
    if name not in _HASH_FUNCTIONS:
        raise ValueError(f"unknown prefix-caching hash {name!r}; choose from {sorted(_HASH_FUNCTIONS)}")
    return _HASH_FUNCTIONS[name]


def init_none_hash(hash_fn: HashFunction) -> BlockHash:
    """The parent hash of block 0. Fixed unless PYTHONHASHSEED is set, so that
    processes (and restarts) share prefix-cache keys."""
    seed = os.environ.get("PYTHONHASHSEED")
    return BlockHash(hash_fn(b"kvserve:none-hash:" + (seed or "").encode()))


def _encode_block(parent_block_hash: bytes, token_ids: Sequence[int], extra_keys: tuple | None) -> bytes:
    # Canonical, length-prefixed: parent hash, tokens as int64, repr of the extra keys
    # (tuples of str/int/bytes, whose repr is stable across processes).
    tokens = array("q", token_ids).tobytes()
    extra = b"" if extra_keys is None else repr(extra_keys).encode()
    return b"".join((len(parent_block_hash).to_bytes(2, "big"), parent_block_hash,
                     len(tokens).to_bytes(4, "big"), tokens, extra))


def hash_block_tokens(
    hash_fn: HashFunction,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Chained hash of one hash unit: parent (None for block 0), tokens, extra keys."""
    if parent_block_hash is None:
        parent_block_hash = init_none_hash(hash_fn)
    return BlockHash(hash_fn(_encode_block(parent_block_hash, curr_block_token_ids, extra_keys)))


def generate_block_extra_keys(request: Any, start_token_idx: int, end_token_idx: int) -> tuple[Any, ...] | None:
    """Extra keys of the hash unit `[start, end)`, in the order LoRA, multimodal, salt.

    LoRA (`request.lora_name`) and multimodal items (`request.mm_features`: objects
    with `identifier`, `offset`, `length`) are optional: requests without them hash
    by tokens and salt only. The salt goes on the first unit only; chaining carries
    it to every later unit.
    """
    keys: list[Any] = []
    lora_name = getattr(request, "lora_name", None)
    if lora_name is not None:
        keys.append(("lora", lora_name))
    for item in getattr(request, "mm_features", None) or ():
        if item.offset < end_token_idx and item.offset + item.length > start_token_idx:
            keys.append(("mm", item.identifier, item.offset - start_token_idx))
    salt = getattr(request, "cache_salt", None)
    if start_token_idx == 0 and salt is not None:
        keys.append(("cache_salt", salt))
    return tuple(keys) if keys else None


def get_request_block_hasher(hash_block_size: int, hash_fn: HashFunction) -> Callable[[Any], list[BlockHash]]:
    """The closure `Request` calls to extend `request.block_hashes`: it returns the
    hashes of the complete `hash_block_size` units not hashed yet."""
    none_hash = init_none_hash(hash_fn)

    def request_block_hasher(request: Any) -> list[BlockHash]:
        token_ids = request.all_token_ids
        start = len(request.block_hashes) * hash_block_size
        parent = request.block_hashes[-1] if request.block_hashes else none_hash
        new_hashes: list[BlockHash] = []
        has_extra_keys = (getattr(request, "lora_name", None) is not None or getattr(request, "mm_features", None)
                          or getattr(request, "cache_salt", None) is not None)
        while start + hash_block_size <= len(token_ids):
            end = start + hash_block_size
            extra_keys = generate_block_extra_keys(request, start, end) if has_extra_keys else None
            parent = BlockHash(hash_fn(_encode_block(parent, token_ids[start:end], extra_keys)))
            new_hashes.append(parent)
            start = end
        return new_hashes

    return request_block_hasher


class BlockHashListWithBlockSize:
    """A read-only view of fine hashes (unit H) at a coarser block size B (H | B):
    coarse hash i is fine hash (i+1)*B/H - 1, the one ending with the block."""

    def __init__(self, block_hashes: list[BlockHash], hash_block_size: int, block_size: int) -> None:
        assert block_size % hash_block_size == 0
        self._hashes = block_hashes
        self._ratio = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._hashes) // self._ratio

    def __getitem__(self, idx: int) -> BlockHash:
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self._hashes[(idx + 1) * self._ratio - 1]

    def __iter__(self) -> Iterable[BlockHash]:
        return (self[i] for i in range(len(self)))


# The layout builder lives in `layout`; it is re-exported here, where vLLM keeps it.
from kvserve.kv_cache.layout import (  # noqa: E402, F401 - re-exported
    get_default_hash_block_size,
    get_kv_cache_config,
    get_scheduler_block_size,
    kv_cache_group_block_sizes,
)
