"""`kvserve bench route`: the workload, the counters, the summary, and (slow) a real run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.bench.replicas import gateway_available
from kvserve.bench.route import (ReplicaCounters, RouteBenchConfig, SentChat, conversations, parse_counters,
                                 policy_trace_path, summarize_policy, trace_of)
from kvserve.bench.serve import RequestResult

METRICS_TEXT = """\
# TYPE vllm:request_success counter
vllm:request_success_total{model_name="m",engine="0",finished_reason="length"} 5.0
vllm:request_success_total{model_name="m",engine="0",finished_reason="stop"} 2.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 400.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{model_name="m",engine="0"} 300.0
"""


def test_parse_counters_sums_label_sets():
    assert parse_counters(METRICS_TEXT) == ReplicaCounters(requests=7, prefix_queries=400, prefix_hits=300)


def test_conversations_share_system_prompts_and_salt_separates_runs():
    config = RouteBenchConfig(num_users=6, num_system_prompts=2, turns=3)
    chats = conversations(config, "run-a")
    assert sorted(c.user for c in chats) == list(range(6))
    assert len({c.system_prompt for c in chats}) == 2
    assert all(len(c.questions) == 3 for c in chats)
    assert [c.user for c in chats] != list(range(6)), "users start interleaved, not in order"
    other = {c.system_prompt for c in conversations(config, "run-b")}
    assert not other & {c.system_prompt for c in chats}


@pytest.mark.parametrize("kwargs, message", [
    ({"policies": ("fastest",)}, "unknown policies"),
    ({"num_system_prompts": 0}, "num_system_prompts"),
    ({"num_replicas": 1}, "power_of_two"),
    ({"num_replicas": 1, "policies": ("random",), "kill_replica_after": 2}, "killing a replica"),
    ({"kill_replica_after": 0}, "kill_replica_after must be between 1 and 23"),
    ({"num_users": 2, "num_system_prompts": 1, "turns": 1, "kill_replica_after": 2}, "between 1 and 1"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_config_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouteBenchConfig(**kwargs)


def test_summary_counts_failures_and_killed_replicas():
    results = [RequestResult(ok=True, prompt_tokens=100, cached_tokens=60, output_tokens=4, ttft_s=0.1, e2e_s=0.2),
               RequestResult(ok=True, prompt_tokens=100, cached_tokens=20, output_tokens=4, ttft_s=0.3, e2e_s=0.4),
               RequestResult(ok=False, error="HTTP 500: upstream")]
    before = [ReplicaCounters(1, 100, 10), ReplicaCounters(0, 0, 0)]
    after = [ReplicaCounters(3, 300, 90), None]
    summary = summarize_policy("cache_aware", results, 2.0, before, after, killed=[1])
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["errors"] == [{"error": "HTTP 500: upstream", "count": 1}]
    assert summary["prefix_hit_rate"] == pytest.approx(0.4)
    assert summary["engine_prefix_hit_rate"] == pytest.approx(0.4)
    assert summary["output_tokens_per_s"] == pytest.approx(4.0)
    assert summary["requests_per_replica"] == [2, None]
    assert summary["ttft_p50_ms"] == pytest.approx(200.0)


class _TokenizingClient:
    """Answers POST /tokenize as a replica would: one token per word of the rendered chat."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.bodies: list[dict] = []

    async def post(self, url: str, json: dict):
        assert url.endswith("/tokenize")
        self.bodies.append(json)
        words = " ".join(f"<{m['role']}> {m['content']}" for m in json["messages"]).split()
        tokens = [self.vocab.setdefault(word, 1000 + len(self.vocab)) for word in words]

        class Response:
            def raise_for_status(self) -> None:
                return None

            def json(self) -> dict:
                return {"count": len(tokens), "tokens": tokens}
        return Response()


def test_route_run_becomes_a_trace_that_kvserve_plan_reads(tmp_path):
    import asyncio

    from kvserve.planner.trace import read_trace, write_trace

    config = RouteBenchConfig(num_users=4, num_system_prompts=2, max_tokens=7, system_prompt_words=20)
    chats = {c.user: c for c in conversations(config, "s")}
    def messages(user: int, *turns: str) -> list[dict]:
        return [{"role": "system", "content": chats[user].system_prompt},
                *({"role": "user", "content": t} for t in turns)]
    sent = [SentChat(0.5, messages(1, "hello there"), chats[1].tenant),
            SentChat(0.0, messages(0, "first question"), chats[0].tenant),
            SentChat(0.2, messages(2, "another question"), chats[2].tenant),
            SentChat(0.9, messages(0, "first question", "second question"), chats[0].tenant)]
    client = _TokenizingClient()
    trace = asyncio.run(trace_of(client, "http://replica", config, sent))
    assert [r.arrival_s for r in trace] == [0.0, 0.2, 0.5, 0.9]
    assert all(body["add_generation_prompt"] and body["model"] == config.served_model_name for body in client.bodies)
    assert all(r.output_len == 7 and r.prompt_len == len(r.prompt_token_ids) for r in trace)
    # Users 0 and 2 share a system prompt (tenant 0): the second shares exactly "<system>", its
    # words and "<user>" with the tenant's first prompt; user 0's second turn shares all of its first.
    first, other_user, tenant_1, second_turn = trace
    assert first.prefix_id == other_user.prefix_id == second_turn.prefix_id == "0" and tenant_1.prefix_id == "1"
    assert first.prefix_len == first.prompt_len and tenant_1.prefix_len == tenant_1.prompt_len
    assert other_user.prefix_len == len(chats[0].system_prompt.split()) + 2
    assert second_turn.prefix_len == first.prompt_len
    path = policy_trace_path(str(tmp_path / "route.trace.jsonl"), "cache_aware", None)
    assert path.endswith("route.trace.cache_aware.jsonl")
    assert policy_trace_path(str(tmp_path / "r.jsonl"), "cache_aware", 3).endswith("r.cache_aware-killed.jsonl")
    write_trace(path, trace)
    assert read_trace(path) == trace
    # Re-planned: the trace replays through `kvserve plan` on the default model's shapes.
    out = tmp_path / "plan.json"
    completed = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "--trace", path, "--policy",
                                "cache_aware", "--tp", "1", "--replicas", "2", "--memory-gib", "1",
                                "--ttft-p99-ms", "1000", "--tpot-p99-ms", "100", "--output-json", str(out)],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["trace_requests"] == 4 and result["best"]["prediction"]["num_requests"] == 4
    # The second turn and the other user find their tenant's prefix cached.
    assert result["best"]["prediction"]["prefix_hit_rate"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not gateway_available(), reason="sglang-router is not installed")
def test_route_bench_end_to_end_with_a_killed_replica(tmp_path):
    out = tmp_path / "route.json"
    command = [sys.executable, "-m", "kvserve.cli", "bench", "route", "--replicas", "2", "--num-users", "4",
               "--num-system-prompts", "2", "--turns", "2", "--max-tokens", "4",
               "--policies", "cache_aware,round_robin", "--kill-replica-after", "3",
               "--output-json", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(out.read_text())["result"]
    assert (tmp_path / "route.png").stat().st_size > 0
    runs = {r["policy"]: r for r in result["runs"]}
    for policy in ("cache_aware", "round_robin"):
        assert runs[policy]["completed"] == 8 and runs[policy]["failed"] == 0
        assert sum(runs[policy]["requests_per_replica"]) == 8
        # Second turns resend the first turn: their system prompt is cached wherever they land.
        assert runs[policy]["prefix_hit_rate"] > 0.2
    assert runs["round_robin"]["requests_per_replica"] == [4, 4]
    fault = runs["cache_aware + replica killed"]
    assert fault["killed_replicas"] == [1] and fault["requests_per_replica"][1] is None
    assert fault["completed"] + fault["failed"] == 8
    assert fault["completed"] >= 3
    # Every run's workload is a trace `kvserve plan --trace` reads: all 8 requests, the prompts as the
    # replicas tokenized them (their own prompt counts agree), system prompts as shared prefixes.
    from kvserve.planner.trace import read_trace
    trace = read_trace(runs["cache_aware"]["trace_path"])
    assert runs["cache_aware"]["trace_path"].endswith("route.trace.cache_aware.jsonl")
    assert len(trace) == 8 and {r.prefix_id for r in trace} == {"0", "1"}
    assert sum(r.prompt_len for r in trace) == runs["cache_aware"]["prompt_tokens"]
    assert all(r.prefix_len >= 100 for r in trace)
    assert len(read_trace(fault["trace_path"])) == 8
    plan = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "--trace", runs["cache_aware"]["trace_path"],
                           "--policy", "cache_aware", "--tp", "1", "--replicas", "2", "--memory-gib", "1",
                           "--ttft-p99-ms", "1000", "--tpot-p99-ms", "100"], capture_output=True, text=True,
                          timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not gateway_available(), reason="sglang-router is not installed")
def test_gateway_forwards_the_clients_api_key_to_a_keyed_replica(tmp_path):
    """docs/replicas.md's N-hosts recipe with --api-key: health checks pass on the open /health, and the
    client's bearer key reaches the replica through the gateway."""
    import httpx

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "tp"))
    from tp_helpers import save_tiny_chat_model

    from kvserve.bench.replicas import start_gateway, start_replica

    model = save_tiny_chat_model(tmp_path / "model")
    replica = start_replica(0, "m", ["--model", model, "--api-key", "sekret", "--max-model-len", "256"], threads=1)
    try:
        gateway = start_gateway([replica.url], "cache_aware", timeout_s=240)
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            url = gateway.url + "/v1/chat/completions"
            keyed = httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"}, timeout=120,
                               trust_env=False)
            assert keyed.status_code == 200 and keyed.json()["usage"]["completion_tokens"] == 2
            bare = httpx.post(url, json=body, timeout=120, trust_env=False)
            assert bare.status_code == 401
        finally:
            gateway.stop()
    finally:
        replica.stop()
