"""`/kv-cache` and `/kv-cache/stream` over a real scheduler and block pool (no model).

Under 64 streaming clients, client aborts and preemptions from a tiny pool, every
snapshot's counts add up per group, and the pool is whole once idle.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from helpers.scheduler_engine import make_scheduler_async_llm

from kvserve.server.app import build_app
from server.conftest import ThreadedServer

MODEL = "fake-model"


def check_counts(doc: dict) -> None:
    """The contract's sums, per group and for the pool."""
    assert doc["num_blocks"] == doc["blocks_in_use"] + doc["blocks_cached"] + doc["blocks_free"], doc
    for group in doc["groups"]:
        assert group["num_blocks"] == group["blocks_in_use"] + group["blocks_cached"] + group["blocks_free"]
        assert min(group["blocks_in_use"], group["blocks_cached"], group["blocks_free"]) >= 0
        assert group["blocks_in_tables"] <= group["blocks_in_use"]
        assert group["blocks_cached_for_group"] <= group["blocks_cached"]
    assert sum(r["num_blocks"] for r in doc["requests"]) >= 0
    assert doc["prefix_cache"]["hits"] <= doc["prefix_cache"]["queries"]


def wait_idle(client: httpx.Client, timeout_s: float = 20) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        doc = client.get("/kv-cache").json()
        if doc["blocks_in_use"] == 0 and not doc["requests"]:
            return doc
        assert time.monotonic() < deadline, doc
        time.sleep(0.05)


@pytest.fixture
def tiny_pool_server(tokenizer):
    engine = make_scheduler_async_llm(tokenizer, num_blocks=48, step_delay_s=0.003, max_num_seqs=16)
    app = build_app(engine, MODEL, api_key="secret-key")
    with ThreadedServer(app) as server:
        yield server, engine


async def _stream_one(client: httpx.AsyncClient, index: int, prompt: str, abort_after: int | None) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True, "temperature": 0}
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                if abort_after is not None and chunks >= abort_after:
                    break  # leaving the stream early disconnects: the server aborts the request
    return chunks


async def _load(base_url: str, headers: dict) -> tuple[list[dict], list[int]]:
    shared = "You are a careful assistant who answers briefly and exactly. " * 3
    snapshots: list[dict] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60,
                                 limits=httpx.Limits(max_connections=100)) as client:
        async def poll():
            while not done.is_set():
                snapshots.append((await client.get("/kv-cache")).json())
                await asyncio.sleep(0.01)

        poller = asyncio.create_task(poll())
        results = await asyncio.gather(*[
            _stream_one(client, i, f"{shared} Question {i}: what is {i} plus {i}?",
                        abort_after=3 if i % 5 == 0 else None)
            for i in range(64)])
        done.set()
        await poller
    return snapshots, results


def test_kv_cache_counts_add_up_under_load_and_pool_is_whole_at_idle(tiny_pool_server):
    server, engine = tiny_pool_server
    headers = {"Authorization": "Bearer secret-key"}
    snapshots, chunks = asyncio.run(_load(server.base_url, headers))
    assert all(n >= 3 for n in chunks)
    assert len(snapshots) > 5
    for doc in snapshots:
        check_counts(doc)
    assert max(doc["blocks_in_use"] for doc in snapshots) > 0
    assert any(doc["requests"] for doc in snapshots)
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=10) as client:
        idle = wait_idle(client)
    check_counts(idle)
    assert idle["blocks_in_use"] == 0 and idle["num_running"] == idle["num_waiting"] == 0
    assert idle["num_preemptions"] > 0, "the tiny pool should have forced preemptions"
    assert idle["blocks_cached"] > 0 and idle["prefix_cache"]["hits"] > 0
    assert idle["steps"] and all(step["num_tokens"] > 0 for step in idle["steps"])
    group = idle["groups"][0]
    assert (group["kind"], group["block_size"], group["sliding_window"]) == ("full", 16, None)
    assert len(idle["eviction_queue_head"]) == min(16, idle["num_blocks"])
    # Unhashed blocks are handed out first: the head lists them before any hashed one.
    hashed = [entry["hashed"] for entry in idle["eviction_queue_head"]]
    assert hashed == sorted(hashed)
    # The engine thread's own pool agrees, and its bookkeeping is consistent.
    pool = engine.engine_core.scheduler.kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == idle["num_blocks"]


def test_kv_cache_requires_the_api_key_and_never_shows_prompt_text(tiny_pool_server):
    server, _ = tiny_pool_server
    assert httpx.get(server.base_url + "/kv-cache").status_code == 401
    assert httpx.get(server.base_url + "/kv-cache/stream").status_code == 401
    headers = {"Authorization": "Bearer secret-key"}
    secret_prompt = "my secret banana prompt"
    response = httpx.post(server.base_url + "/v1/completions", headers=headers, timeout=30,
                          json={"model": MODEL, "prompt": secret_prompt, "max_tokens": 5})
    assert response.status_code == 200
    text = httpx.get(server.base_url + "/kv-cache", headers=headers).text
    assert "banana" not in text


def test_kv_cache_stream_sends_snapshots(tiny_pool_server):
    server, _ = tiny_pool_server
    headers = {"Authorization": "Bearer secret-key"}
    bad = httpx.get(server.base_url + "/kv-cache/stream?interval_ms=5", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval_ms"
    docs = []
    with httpx.stream("GET", server.base_url + "/kv-cache/stream?interval_ms=100", headers=headers,
                      timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                docs.append(json.loads(line[len("data: "):]))
                if len(docs) == 3:
                    break
    for doc in docs:
        check_counts(doc)
    assert docs[0]["timestamp"] < docs[2]["timestamp"]


def test_kv_cache_shows_each_group_of_a_hybrid_model(tokenizer):
    """Full, sliding-window and recurrent-state groups, each under its own kind; a
    repeated prompt restores the state group from a cached snapshot."""
    from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec, StateSpec
    spec = dict(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
    state = StateSpec(block_size=16, shapes=((3, 8), (8,)), dtype="float32")
    specs = {"layer.0": FullAttentionSpec(**spec), "layer.1": SlidingWindowSpec(**spec, sliding_window=32),
             "layer.2": FullAttentionSpec(**spec), "layer.3": state}
    engine = make_scheduler_async_llm(tokenizer, num_blocks=120, specs=specs)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        body = {"model": MODEL, "prompt": "a long enough prompt to fill a few blocks " * 6, "max_tokens": 30}
        for _ in range(2):
            assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            idle = wait_idle(client)
    check_counts(idle)
    groups = {group["kind"]: group for group in idle["groups"]}
    assert set(groups) == {"full", "sliding_window", "state"}
    assert groups["full"]["num_layers"] == 2 and groups["sliding_window"]["num_layers"] == 1
    assert groups["state"]["num_layers"] == 1 and groups["state"]["block_size"] == 16
    assert groups["sliding_window"]["sliding_window"] == 32 and groups["full"]["sliding_window"] is None
    # The state group draws from a pool of its own (#29), the others share the main pool:
    # each group reports its pool's counts and has cached blocks of its own.
    state_pool = idle["state_pool"]
    assert state_pool["num_blocks"] == state_pool["blocks_in_use"] + state_pool["blocks_cached"] + state_pool[
        "blocks_free"]
    assert {key: groups["state"][key] for key in state_pool} == state_pool
    attention_groups = [group for group in idle["groups"] if group["kind"] != "state"]
    assert all(group["num_blocks"] == idle["num_blocks"] for group in attention_groups)
    assert all(group["blocks_cached_for_group"] > 0 for group in idle["groups"])
    assert sum(group["blocks_cached_for_group"] for group in attention_groups) == idle["blocks_cached"]
    assert groups["state"]["blocks_cached_for_group"] == state_pool["blocks_cached"]
    # The second request hit: one snapshot restored in the state group, blocks in the others.
    assert groups["state"]["hit_blocks"] == 1 and groups["full"]["hit_blocks"] > 0
