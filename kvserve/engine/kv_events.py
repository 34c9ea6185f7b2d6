"""KV-cache events on the wire in vLLM's format, for KV-aware routers (llm-d, Dynamo).

Source of the format: vLLM 0.33.0's `vllm/distributed/kv_events.py`,
`vllm/config/kv_events.py` and `vllm/v1/core/block_pool.py` (read, not
imported), which refine /work/shared/reference/ecosystem-contracts.md: the
events are msgspec *map* structs there, only the batch is array-like.

`--kv-events-config` takes vLLM's JSON (`KVEventsConfig`). With
`enable_kv_cache_events` (publisher "zmq", the default then), each engine
step's events from the block pool become one `KVEventBatch`, sent on a ZMQ
PUB socket as three frames: topic, sequence number (8 bytes, big-endian,
from 0), and the batch as msgpack:

    KVEventBatch     [ts: float, events: list, data_parallel_rank: int]
    BlockStored      {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
                      "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx"}
    BlockRemoved     {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}
    AllBlocksCleared {"type": "AllBlocksCleared"}

(msgspec's tagged structs: the tag field "type" holds the class name; fields
left at their default are omitted). Block hashes go out as vLLM sends them by
default: the low 64 bits of the hash as an unsigned int
(KVSERVE_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends the raw hash bytes, like
vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0). `block_size` is the hash unit
(the block size unless --hash-block-size is finer). `medium` is "GPU", vLLM's
name for the engine's own KV cache (as opposed to an offloaded CPU or storage
tier), on CPU too. `extra_keys` is one null per block: kvserve publishes no
LoRA or multimodal keys. An endpoint with "*" (or "::", ipc://, inproc://) is
bound, any other is connected to, as vLLM does. A ROUTER socket at
`replay_endpoint` answers `(client_id, b"", start_seq)` with
`(client_id, b"", topic, seq, payload)` for every buffered batch from
`start_seq` (the last `buffer_steps` are kept), then
`(client_id, b"", b"", seq -1, b"")`.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Any

from kvserve.errors import ConfigError
from kvserve.kv_cache.events import (
    AllBlocksClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    KVCacheEvent,
    KVEventsConfig,
)

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
_POLL_MS = 50
_END_OF_REPLAY_SEQ = (-1).to_bytes(8, "big", signed=True)


def _wire_hash(block_hash: bytes, as_int: bool) -> int | bytes:
    return int.from_bytes(block_hash[-8:], "big", signed=False) if as_int else bytes(block_hash)


def event_to_wire(event: KVCacheEvent, as_int: bool) -> dict:
    """One event as vLLM's msgspec struct encodes it (a map, tag first)."""
    if isinstance(event, BlockStoredEvent):
        parent = None if event.parent_block_hash is None else _wire_hash(event.parent_block_hash, as_int)
        return {"type": "BlockStored", "block_hashes": [_wire_hash(h, as_int) for h in event.block_hashes],
                "parent_block_hash": parent, "token_ids": list(event.token_ids), "block_size": event.block_size,
                "lora_id": None, "medium": MEDIUM, "lora_name": None,
                "extra_keys": [None] * len(event.block_hashes), "group_idx": event.group_id}
    if isinstance(event, BlockRemovedEvent):
        return {"type": "BlockRemoved", "block_hashes": [_wire_hash(h, as_int) for h in event.block_hashes],
                "medium": MEDIUM, "group_idx": event.group_id}
    if isinstance(event, AllBlocksClearedEvent):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(events: list[KVCacheEvent], ts: float, *, as_int: bool = True, data_parallel_rank: int = 0) -> bytes:
    """A `KVEventBatch` payload (msgpack)."""
    import msgpack
    wire = [event_to_wire(event, as_int) for event in events]
    return msgpack.packb([ts, wire, data_parallel_rank], use_bin_type=True)


def int_hashes_from_env() -> bool:
    return os.environ.get("KVSERVE_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") not in ("0", "false", "False")


def _bind_or_connect(socket: Any, endpoint: str) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


class ZmqEventPublisher:
    """Sends batches from a thread of its own (ZMQ sockets stay on that thread).

    `publish` never blocks the engine: past `max_queue_size` waiting batches the
    newest is dropped with a warning (a router then sees a sequence gap).
    """

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq  # noqa: F401 - fail at start-up, not in the thread, when pyzmq is missing
        self.config = config
        self.as_int = int_hashes_from_env()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise ConfigError(f"kv-events-config: cannot open {config.endpoint}: {self._error}")

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events, time.time(), as_int=self.as_int)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            logger.warning("KV-event queue full (%d batches): dropping a batch", self.config.max_queue_size)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        import zmq
        context = zmq.Context.instance()
        try:
            pub = context.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            _bind_or_connect(pub, self.config.endpoint)
            replay = None
            if self.config.replay_endpoint:
                replay = context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # Room for a whole replay and its end marker.
                replay.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _serve(self, pub: Any, replay: Any) -> None:
        import zmq
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        poller = zmq.Poller()
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        while True:
            try:
                payload = self._queue.get(timeout=_POLL_MS / 1e3 if replay is None else 0)
            except queue.Empty:
                payload = None
            if payload is not None:
                seq_bytes = seq.to_bytes(8, "big")
                pub.send_multipart((topic, seq_bytes, payload))
                buffer.append((seq, payload))
                seq += 1
            elif self._stop.is_set():
                return
            if replay is not None and poller.poll(_POLL_MS if payload is None else 0):
                self._answer_replay(replay, buffer, topic)

    @staticmethod
    def _answer_replay(replay: Any, buffer: deque, topic: bytes) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if seq >= start_seq:
                replay.send_multipart((client_id, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client_id, b"", b"", _END_OF_REPLAY_SEQ, b""))


def create_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher for `config`, or None when events are off (null publisher)."""
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config)
