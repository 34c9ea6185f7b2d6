"""The vLLM reference paths of the scheduler and KV-cache benches.

vLLM is an optional reference, never a dependency: these tests skip where it
is not importable (CI). Where it is, the same scenario must run through both
engines and come back as measurements, not error entries.
"""
import importlib.util

import pytest

from kvserve.bench import kv as kv_bench
from kvserve.bench import scheduler as scheduler_bench

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not importable")


def test_scheduler_bench_runs_same_scenario_through_vllm():
    result = scheduler_bench.run(num_running=(4,), prompt_len=40, output_len=12, block_size=16,
                                 num_timed_steps=5)
    ours, theirs = result["kvserve"]["4"], result["vllm"]["4"]
    assert "error" not in theirs, theirs.get("error")
    # Same trace on both sides: every request decoding, the same number of timed steps.
    assert theirs["num_running"] == ours["num_running"] == 4
    assert theirs["steps"] == ours["steps"]
    assert theirs["us_per_step"] > 0
    assert result["ratio_kvserve_over_vllm"]["4"] == pytest.approx(ours["us_per_step"] / theirs["us_per_step"])


def test_kv_bench_runs_same_trace_through_vllm():
    result = kv_bench.run(num_requests=200, num_prefixes=4, prefix_len=64, suffix_len=16, max_running=8)
    comparison = result["vllm"]
    assert comparison is not None and "error" not in comparison, comparison
    for phase in ("allocate_free", "prefix_hit"):
        assert comparison[phase]["ops_per_s"] > 0
        assert comparison[f"{phase}_ratio"] == pytest.approx(
            result[phase]["ops_per_s"] / comparison[phase]["ops_per_s"])
    # vLLM's own prefix cache is the oracle for how many prompt tokens are hits.
    assert comparison["prefix_hit"]["hit_rate"] == pytest.approx(result["prefix_hit"]["hit_rate"])
    assert comparison["allocate_free"]["hit_rate"] == result["allocate_free"]["hit_rate"] == 0.0
