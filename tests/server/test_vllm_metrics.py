"""/metrics under vLLM's names and labels, parsed by prometheus_client's own parser."""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.test_kv_cache_view import MODEL, tiny_pool_server, wait_idle  # noqa: F401 - fixture

# vLLM's documented metrics (name as the family, i.e. without _total) and their types.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


def scrape(base_url: str) -> dict:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(family, suffix: str = "", **labels) -> float:
    matches = [s.value for s in family.samples if s.name == family.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (family.name, suffix, labels, family.samples)
    return matches[0]


def test_vllm_names_labels_and_kv_block_extensions(tiny_pool_server):
    server, _ = tiny_pool_server
    headers = {"Authorization": "Bearer secret-key"}
    prompt = "The same long system prompt, shared by both requests, padded out. " * 4
    for _ in range(2):
        response = httpx.post(server.base_url + "/v1/completions", headers=headers, timeout=30,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert response.status_code == 200
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=10) as client:
        kv = wait_idle(client)
    families = scrape(server.base_url)
    for name, kind in VLLM_METRICS.items():
        assert name in families, name
        assert families[name].type == kind, name
        for s in families[name].samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", s
    assert sample(families["vllm:request_success"], "_total", finished_reason="length") == 2
    assert sample(families["vllm:generation_tokens"], "_total") == 12
    assert sample(families["vllm:prompt_tokens"], "_total") == kv["prefix_cache"]["queries"]
    assert sample(families["vllm:time_to_first_token_seconds"], "_count") == 2
    assert sample(families["vllm:e2e_request_latency_seconds"], "_count") == 2
    assert sample(families["vllm:inter_token_latency_seconds"], "_count") == 10
    assert sample(families["vllm:prefix_cache_hits"], "_total") == kv["prefix_cache"]["hits"] > 0
    assert sample(families["vllm:prefix_cache_queries"], "_total") == kv["prefix_cache"]["queries"]
    assert sample(families["vllm:num_requests_running"]) == 0
    # vLLM's usage drops to 0 at idle; the block gauges still show the resident prefix.
    assert sample(families["vllm:kv_cache_usage_perc"]) == 0
    blocks = families["kvserve_kv_cache_blocks"]
    by_state = {state: sample(blocks, group="0", kind="full", state=state) for state in ("in_use", "cached", "free")}
    assert by_state == {"in_use": 0, "cached": kv["blocks_cached"], "free": kv["blocks_free"]}
    assert sum(by_state.values()) == kv["num_blocks"]
    assert by_state["cached"] > 0
    assert sample(families["kvserve_kv_cache_group_blocks"], group="0", state="cached") == by_state["cached"]
    assert sample(families["kvserve_num_requests_preempted"]) == 0


def test_metrics_stay_open_without_the_key(tiny_pool_server):
    server, _ = tiny_pool_server
    assert httpx.get(server.base_url + "/metrics", timeout=10).status_code == 200


def test_a_hybrid_models_state_pool_shows_under_its_group(tokenizer):
    """Full, sliding-window and state groups, the state group in a pool of its own (#29):
    `kvserve_kv_cache_blocks` gives each group its pool's counts, the same as `/kv-cache`."""
    from helpers.scheduler_engine import make_scheduler_async_llm

    from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec, StateSpec
    from kvserve.server.app import build_app
    from server.conftest import ThreadedServer
    spec = dict(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
    specs = {"layer.0": FullAttentionSpec(**spec), "layer.1": SlidingWindowSpec(**spec, sliding_window=32),
             "layer.2": StateSpec(block_size=16, shapes=((3, 8), (8,)), dtype="float32")}
    engine = make_scheduler_async_llm(tokenizer, num_blocks=120, specs=specs)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        body = {"model": MODEL, "prompt": "a long enough prompt to fill a few blocks " * 6, "max_tokens": 30}
        assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
        with httpx.Client(base_url=server.base_url, timeout=10) as client:
            idle = wait_idle(client)
        families = scrape(server.base_url)
    blocks = families["kvserve_kv_cache_blocks"]
    pools = {"full": idle, "sliding_window": idle, "state": idle["state_pool"]}
    for kind, pool in pools.items():
        by_state = {state: sample(blocks, kind=kind, state=state) for state in ("in_use", "cached", "free")}
        assert by_state == {"in_use": pool["blocks_in_use"], "cached": pool["blocks_cached"],
                            "free": pool["blocks_free"]}, kind
    assert idle["state_pool"]["num_blocks"] != idle["num_blocks"]
    assert idle["state_pool"]["blocks_cached"] > 0
    assert sample(families["vllm:kv_cache_usage_perc"]) == 0.0
