"""KV events in vLLM's wire format, read back by a pyzmq subscriber and a msgpack decoder
written from the MessagePack spec (tests/helpers/msgpack_decoder.py), not kvserve's encoder.

The documented format (vLLM 0.33.0): frames (topic, seq as 8-byte big-endian, payload);
payload = [ts, events, data_parallel_rank]; events are maps tagged by "type". A router
keeping a set of hashes from the events must end with exactly the pool's cached keys.
"""
from __future__ import annotations

import hashlib
import socket
import time

import pytest
import zmq
from helpers.msgpack_decoder import decode_msgpack
from helpers.scheduler_engine import make_scheduler_engine_core

from kvserve.engine.core import EngineCoreRequest
from kvserve.errors import ConfigError
from kvserve.kv_cache.events import KVEventsConfig
from kvserve.kv_cache.utils import get_block_hash, get_group_id, hash_block_tokens
from kvserve.sampling_params import SamplingParams
from kvserve.engine.create_config import create_engine_config

TOPIC = b"kvserve-test"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def low64(hash_bytes: bytes) -> int:
    return int.from_bytes(hash_bytes, "big") & ((1 << 64) - 1)


def run(core, request_id: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id, prompt, params))
    deadline = time.monotonic() + 30
    while core.has_unfinished_requests():
        core.step()
        assert time.monotonic() < deadline


def receive_all(sub, expected_min: int = 1, timeout_s: float = 5.0) -> list[list[bytes]]:
    messages = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            messages.append(sub.recv_multipart())
        elif len(messages) >= expected_min:
            break
    return messages


def decode_batch(frames: list[bytes]) -> tuple[int, list]:
    topic, seq, payload = frames
    assert topic == TOPIC and len(seq) == 8
    batch = decode_msgpack(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, dp_rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 120 and dp_rank == 0
    return int.from_bytes(seq, "big"), events


@pytest.fixture(params=[None], ids=["hash=block"])
def published_engine(request):
    pub_port, replay_port = free_ports(2)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": TOPIC.decode(), "buffer_steps": 1000}
    # 13 usable blocks of 16 tokens: the second prompt must evict the first one's blocks.
    core = make_scheduler_engine_core(num_blocks=14, step_delay_s=0.0, async_scheduling=False,
                                      kv_events_config=config, hash_block_size=request.param)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)  # let the subscription reach the publisher (ZMQ's slow joiner)
    try:
        yield core, sub, replay_port
    finally:
        sub.close(0)
        core.shutdown()


def test_events_follow_the_pool_exactly(published_engine):
    core, sub, replay_port = published_engine
    pool = core.scheduler.kv_cache_manager.block_pool
    first = [(7 * i) % 1000 for i in range(1, 41)]
    run(core, "first", first, max_tokens=16)            # 56 tokens: 3 full blocks cached
    second = [(11 * i + 3) % 1000 for i in range(1, 161)]
    run(core, "second", second, max_tokens=8)           # 168 tokens: 11 blocks, evicts "first"
    assert core.reset_prefix_cache()

    messages = receive_all(sub, expected_min=3)
    decoded = [decode_batch(frames) for frames in messages]
    assert [seq for seq, _ in decoded] == list(range(len(decoded)))
    events = [event for _, batch in decoded for event in batch]
    kinds = [event["type"] for event in events]
    assert {"BlockStored", "BlockRemoved"} <= set(kinds) and kinds[-1] == "AllBlocksCleared"

    # The first stored run is the first prompt's first block: parent None, its tokens, sha256 chain.
    stored = events[kinds.index("BlockStored")]
    assert stored["parent_block_hash"] is None and stored["block_size"] == 16
    assert stored["token_ids"][:16] == first[:16]
    assert stored["medium"] == "GPU" and stored["group_idx"] == 0
    assert stored["lora_id"] is None and stored["lora_name"] is None
    assert stored["extra_keys"] == [None] * len(stored["block_hashes"])
    expected_hash = hash_block_tokens(lambda data: hashlib.sha256(data).digest(), None, first[:16])
    assert stored["block_hashes"][0] == low64(expected_hash)

    # A router's set of hashes, replayed from the events, matches the pool at every check.
    router: set[int] = set()
    before_reset: set[int] | None = None
    for event in events:
        if event["type"] == "BlockStored":
            assert len(event["token_ids"]) == 16 * len(event["block_hashes"])
            assert event["parent_block_hash"] is None or event["parent_block_hash"] in router
            assert not router & set(event["block_hashes"]), "a stored hash was already cached"
            router |= set(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            assert set(event["block_hashes"]) <= router, "removed a hash never stored"
            assert event["medium"] == "GPU" and event["group_idx"] == 0
            router -= set(event["block_hashes"])
        else:
            assert set(event) == {"type"}
            before_reset = set(router)
            router.clear()
    pool_keys = {low64(get_block_hash(key)) for key in pool.cached_block_hash_to_block}
    assert router == pool_keys == set()
    assert before_reset, "the reset came after cached blocks"
    # Replay from seq 1 returns the same payloads, then the end marker.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                assert frames[1] == b"" and frames[3] == b""
                break
            replayed.append(frames[1:])
        assert replayed == messages[1:]
    finally:
        dealer.close(0)


def test_group_ids_survive_in_removed_events(published_engine):
    core, sub, _ = published_engine
    run(core, "a", list(range(1, 50)), max_tokens=4)
    run(core, "b", list(range(300, 470)), max_tokens=4)
    events = [e for frames in receive_all(sub, 2) for e in decode_batch(frames)[1]]
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    assert removed and all(e["group_idx"] == 0 for e in removed)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert {get_group_id(k) for k in pool.cached_block_hash_to_block} <= {0}


def test_config_is_vllms_json():
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    assert KVEventsConfig.from_json("{}").publisher == "null"
    assert not KVEventsConfig.from_json("{}").publishes
    for bad in ("[1]", "{", '{"publisher": "kafka"}', '{"buffer_steps": 0}', '{"nope": 1}',
                '{"enable_kv_cache_events": "yes"}'):
        with pytest.raises(ConfigError):
            KVEventsConfig.from_json(bad)


def test_disabled_events_record_nothing():
    core = make_scheduler_engine_core(num_blocks=14, step_delay_s=0.0, async_scheduling=False)
    try:
        assert core.kv_event_publisher is None
        assert core.scheduler.kv_cache_manager.block_pool.kv_events is None
        run(core, "x", list(range(1, 40)), max_tokens=4)
    finally:
        core.shutdown()


def test_the_flag_reaches_the_engine_config():
    import argparse

    from kvserve.engine.arg_utils import add_engine_arguments, engine_kwargs_from_args
    parser = add_engine_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "topic": "t"}'])
    config = create_engine_config(**engine_kwargs_from_args(args))
    assert config.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="t")
    with pytest.raises(ConfigError, match="kv-events-config"):
        create_engine_config(kv_events_config='{"enable_kv_cache_events": true, "hwm": -1}')


@pytest.mark.parametrize("published_engine", [4], ids=["hash=4"], indirect=True)
def test_sub_block_hash_units_are_events_of_their_own(published_engine):
    """With --hash-block-size 4 a 16-token block carries 4 keys: each is announced as a unit of 4."""
    core, sub, _ = published_engine
    pool = core.scheduler.kv_cache_manager.block_pool
    run(core, "a", list(range(1, 38)), max_tokens=6)
    run(core, "b", list(range(1, 30)) + [999] * 8, max_tokens=6)   # shares 29 tokens with "a"
    router: set[int] = set()
    for frames in receive_all(sub, 2):
        for event in decode_batch(frames)[1]:
            if event["type"] == "BlockStored":
                assert event["block_size"] == 4 and len(event["token_ids"]) == 4 * len(event["block_hashes"])
                router |= set(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                router -= set(event["block_hashes"])
    assert router == {low64(get_block_hash(key)) for key in pool.cached_block_hash_to_block}
    assert len(router) >= 37 // 4
