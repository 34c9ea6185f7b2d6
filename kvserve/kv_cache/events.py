"""KV-cache events recorded by the block pool: a prefix-cache key appeared, left, or all left.

The pool records an event only when the set of keys in its map changes: a key
stored on a second block with the same content is not news, and a key leaves
only with its last block. A consumer that keeps a set of hashes per replica
(a KV-aware router) therefore stays exact. Recording is off (`None` recorder
on the pool) unless KV events are enabled, so it costs nothing by default.
Hashes are `BlockHash` bytes; the engine encodes them for the wire.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Sequence, Union

from kvserve.errors import ConfigError
from kvserve.kv_cache.utils import BlockHash


@dataclass
class BlockStoredEvent:
    """Consecutive hash units of one prefix became cached in one group.

    `block_hashes[i]` covers tokens `token_ids[i*block_size:(i+1)*block_size]`
    of the unit after `parent_block_hash` (None: the prompt's first unit).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    group_id: int


@dataclass
class BlockRemovedEvent:
    """These hashes are no longer cached in one group (evicted)."""

    block_hashes: list[BlockHash]
    group_id: int


@dataclass
class AllBlocksClearedEvent:
    """The prefix cache was reset: nothing is cached any more."""


KVCacheEvent = Union[BlockStoredEvent, BlockRemovedEvent, AllBlocksClearedEvent]


@dataclass
class KVEventRecorder:
    """Collects the pool's events until `take()`; runs of one prefix merge into one event."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def stored(self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Sequence[int],
               unit_size: int, group_id: int) -> None:
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStoredEvent) and last.group_id == group_id and last.block_size == unit_size
                and parent is not None and last.block_hashes[-1] == parent):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStoredEvent([block_hash], parent, list(token_ids), unit_size, group_id))

    def removed(self, block_hash: BlockHash, group_id: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemovedEvent) and last.group_id == group_id:
            last.block_hashes.append(block_hash)
            return
        self.events.append(BlockRemovedEvent([block_hash], group_id))

    def cleared(self) -> None:
        self.events.append(AllBlocksClearedEvent())

    def take(self) -> list[KVCacheEvent]:
        """The events since the previous call, oldest first."""
        events, self.events = self.events, []
        return events


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` fields (`max_queue_size`: batches waiting to be sent)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("null", "zmq"):
            raise ConfigError(f"kv-events-config: publisher must be 'null' or 'zmq', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"kv-events-config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.endpoint, str) or not self.endpoint:
            raise ConfigError("kv-events-config: endpoint must be a non-empty string such as tcp://*:5557")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse the flag's JSON; unknown or mistyped fields raise ConfigError."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError("kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
        if not isinstance(raw.get("enable_kv_cache_events", False), bool):
            raise ConfigError("kv-events-config: enable_kv_cache_events must be true or false")
        return cls(**raw)
