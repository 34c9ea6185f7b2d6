"""kvserve replicas behind SGLang's Model Gateway (`sglang-router`).

The replicas are the real HTTP stack over the model-free engine core, so the
gateway's registration, health checks and load polling hit kvserve's own
routes; the gateway itself is the real package, started as a subprocess on
127.0.0.1. Which replica served a request is read from its /metrics.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvserve.bench.replicas import GATEWAY_POLICIES, gateway_available, start_gateway
from kvserve.bench.route import parse_counters
from kvserve.server.app import build_app
from kvserve.server.gateway import kv_capacity_tokens

from .conftest import ThreadedServer
from .fake_engine import make_fake_async_llm

MODEL = "fake-model"
NUM_BLOCKS = 512  # the fake executor's pool, the null block included
BLOCK_SIZE = 16


def _replica_engine(tokenizer, step_delay_s: float = 0.002):
    engine = make_fake_async_llm(tokenizer, max_model_len=256, max_num_seqs=4, step_delay_s=step_delay_s)
    assert engine.engine_core.kv_cache_config.num_blocks == NUM_BLOCKS
    assert engine.engine_config.cache_config.block_size == BLOCK_SIZE
    return engine


@pytest.fixture(scope="module")
def replicas(tokenizer):
    servers = []
    try:
        for _ in range(2):
            engine = _replica_engine(tokenizer)
            server = ThreadedServer(build_app(engine, MODEL)).__enter__()
            server.engine = engine
            servers.append(server)
        yield servers
    finally:
        for server in servers:
            server.__exit__(None, None, None)


def _served_counts(replicas) -> list[float]:
    return [parse_counters(httpx.get(r.base_url + "/metrics").text).requests for r in replicas]


def _chat(base_url: str, content: str, max_tokens: int = 4) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_worker_routes_report_engine_numbers(replicas):
    replica = replicas[0]
    load = httpx.get(replica.base_url + "/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0, "num_in_flight_reqs": 0,
                     "kv_cache_usage": 0.0, "kv_capacity_tokens": (NUM_BLOCKS - 1) * BLOCK_SIZE}]
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(replica.base_url + path).json()
        assert info["served_model_name"] == MODEL
        assert info["max_total_num_tokens"] == (NUM_BLOCKS - 1) * BLOCK_SIZE
        assert info["context_length"] == 256 and info["max_running_requests"] == 4
        assert info["dp_size"] == 1 and info["tp_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(replica.base_url + path).json()["is_generation"] is True


def test_get_load_counts_running_requests_and_their_tokens(tokenizer):
    engine = _replica_engine(tokenizer, step_delay_s=0.05)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        threads = [threading.Thread(target=_chat, args=(server.base_url, f"question {i} " * 20, 60))
                   for i in range(6)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        load = None
        while time.monotonic() < deadline:
            load = httpx.get(server.base_url + "/get_load").json()[0]
            if load["num_reqs"] == 4 and load["num_waiting_reqs"] == 2:
                break
            time.sleep(0.02)
        for thread in threads:
            thread.join(30)
    assert load["num_reqs"] == 4 and load["num_waiting_reqs"] == 2, load
    # The tokens held are the fake core's block count times the block size, as the engine reported them.
    assert load["num_tokens"] > 0 and load["num_tokens"] % BLOCK_SIZE == 0
    assert load["num_tokens"] == round(load["kv_cache_usage"] * kv_capacity_tokens(engine))


gateway_required = pytest.mark.skipif(not gateway_available(), reason="sglang-router is not installed")


@gateway_required
@pytest.mark.parametrize("policy", GATEWAY_POLICIES)
def test_gateway_routes_every_policy_through_kvserve(replicas, policy):
    gateway = start_gateway([r.base_url for r in replicas], policy)
    try:
        models = httpx.get(gateway.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL]
        prompts = [f"tenant {t} asks about topic {t} " * 8 for t in range(4)]
        direct = {p: _chat(replicas[0].base_url, p)["choices"][0]["message"] for p in prompts}
        before = _served_counts(replicas)
        served_by: dict[str, list[int]] = {}
        for prompt in prompts * 2:
            counts_before = _served_counts(replicas)
            assert _chat(gateway.url, prompt)["choices"][0]["message"] == direct[prompt]
            counts_after = _served_counts(replicas)
            changed = [i for i, (a, b) in enumerate(zip(counts_after, counts_before)) if a - b == 1]
            assert len(changed) == 1 and sum(counts_after) - sum(counts_before) == 1, (counts_before, counts_after)
            served_by.setdefault(prompt, []).append(changed[0])
        assert sum(a - b for a, b in zip(_served_counts(replicas), before)) == 8
        # Gateway's view of the load comes from each replica's /get_load.
        loads = httpx.get(gateway.url + "/get_loads").json()["workers"]
        assert sorted(w["worker"] for w in loads) == sorted(r.base_url for r in replicas)
        assert all(w["load"] == 0 for w in loads)
    finally:
        gateway.stop()
    if policy == "round_robin":
        routed_counts = [sum(1 for ids in served_by.values() for i in ids if i == k) for k in range(2)]
        assert routed_counts == [4, 4]
    if policy == "cache_aware":
        assert all(len(set(ids)) == 1 for ids in served_by.values()), served_by


@gateway_required
def test_gateway_rejects_unknown_policy():
    with pytest.raises(ValueError, match="unknown gateway policy"):
        start_gateway(["http://127.0.0.1:1"], "fastest")


@gateway_required
def test_gateway_drops_a_replica_whose_engine_died(tokenizer):
    """/health turns 503 when a replica's executor dies (e.g. a lost node, found by heartbeat
    while idle): the gateway's health check marks it unhealthy and routes around it."""
    engines = [_replica_engine(tokenizer) for _ in range(2)]
    servers = [ThreadedServer(build_app(engine, MODEL)).__enter__() for engine in engines]
    gateway = None
    try:
        gateway = start_gateway([s.base_url for s in servers], "round_robin")
        engines[1].engine_core.executor.kill("lost tensor-parallel rank 1 on node 1", when="now")
        assert httpx.get(servers[1].base_url + "/health").status_code == 503
        # The gateway checks every 1 s and drops a worker after 2 failures (start_gateway's flags).
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            workers = httpx.get(gateway.url + "/workers").json()["workers"]
            health = {w["url"]: w["is_healthy"] for w in workers}
            if health.get(servers[1].base_url) is False:
                break
            time.sleep(0.2)
        assert health == {servers[0].base_url: True, servers[1].base_url: False}, workers
        before = _served_counts(servers[:1])
        for i in range(4):
            _chat(gateway.url, f"still served {i}")
        assert _served_counts(servers[:1])[0] - before[0] == 4
    finally:
        if gateway is not None:
            gateway.stop()
        for server in servers:
            server.__exit__(None, None, None)
