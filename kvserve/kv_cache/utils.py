"""Blocks, the free queue and block hashing."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheBlockCopy:
    """Copy the first `num_tokens` token slots of one block into another, within one
    KV-cache group, before the forward pass that reads the destination (CoW)."""

    group_id: int
    src_block_id: int
    dst_block_id: int
    num_tokens: int
