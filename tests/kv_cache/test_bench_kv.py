"""The KV-cache benchmark runs at a tiny size and reports what the trace implies."""
import json
import subprocess
import sys

from kvserve.bench import kv


def test_tiny_run_reports_rates_and_the_expected_hit_rate():
    result = kv.run(num_requests=50, block_size=16, num_prefixes=2, prefix_len=32, suffix_len=8, max_running=4)
    assert result["trace"]["num_requests"] == 50
    for phase in ("allocate_free", "prefix_hit"):
        assert result[phase]["ops_per_s"] > 0 and result[phase]["elapsed_s"] > 0
    assert result["allocate_free"]["hit_rate"] == 0.0
    # Every request but the first of each prefix hits its 2 full prefix blocks.
    assert result["prefix_hit"]["hit_rate"] == (50 - 2) * 32 / (50 * 40)


def test_trace_is_deterministic():
    assert kv.make_trace(5, 2, 8, 3, seed=1) == kv.make_trace(5, 2, 8, 3, seed=1)
    assert kv.make_trace(5, 2, 8, 3, seed=1) != kv.make_trace(5, 2, 8, 3, seed=2)


def test_module_prints_json():
    out = subprocess.run([sys.executable, "-m", "kvserve.bench.kv", "--num-requests", "20", "--no-vllm"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["trace"]["num_requests"] == 20
