"""`kvserve bench route`: the workload, the counters, the summary, and (slow) a real run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.bench.replicas import gateway_available
from kvserve.bench.route import (ReplicaCounters, RouteBenchConfig, conversations, parse_counters,
                                 summarize_policy)
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
