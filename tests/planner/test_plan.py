"""`kvserve plan`: the step-cost model, KV sizing, the simulated replica and the search."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.planner.plan import (SLO, Load, Machine, ModelSpec, StepCost, kv_tokens_per_replica, plan,
                                simulate_replica, synthetic_trace)

# A 7B-like decoder: 32 layers, 4096 wide, 8 KV heads of 128.
MODEL = ModelSpec(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                  matmul_params=7_000_000_000, dtype_bytes=2)
GPU = Machine(memory_gib=80, bandwidth_gbs=3350, tflops=990, interconnect_gbs=100, devices_per_node=8)


def test_step_cost_is_bandwidth_bound_for_decode_and_compute_bound_for_prefill():
    cost = StepCost(MODEL, GPU, tp=1)
    overhead_s = GPU.step_overhead_ms / 1000
    decode = cost.seconds(1, 0) - overhead_s
    assert decode == pytest.approx(MODEL.weight_bytes / 3350e9)
    prefill = cost.seconds(8192, 0) - overhead_s
    assert prefill == pytest.approx(8192 * 2 * MODEL.matmul_params / 990e12)
    # TP halves the weight read per rank but adds all-reduces.
    tp2 = StepCost(MODEL, GPU, tp=2)
    assert tp2.seconds(1, 0) - overhead_s > decode / 2
    assert tp2.seconds(1, 0) < cost.seconds(1, 0)


def test_kv_budget_is_memory_left_after_the_weight_slice():
    tp1 = kv_tokens_per_replica(MODEL, GPU, 1)
    expected = (80 * 1024 ** 3 * 0.9 - MODEL.weight_bytes) / MODEL.kv_bytes_per_token
    assert tp1 == int(expected)
    assert kv_tokens_per_replica(MODEL, GPU, 2) > 2 * tp1
    too_big = ModelSpec(80, 8192, 64, 8, 128, 70_000_000_000, 2)
    assert kv_tokens_per_replica(too_big, GPU, 1) == 0


def test_simulated_replica_hits_shared_prefixes_and_queues_under_load():
    load = Load(arrival_rate=1.0, prompt_len_median=256, output_len_median=16, shared_prefix_ratio=0.75,
                num_shared_prefixes=2, max_model_len=1024)
    cost = StepCost(MODEL, GPU, tp=1)
    light = simulate_replica(cost, 200_000, synthetic_trace(load, 1.0, 60, seed=0))
    assert light["feasible"] and light["num_requests"] == 60
    assert 0.5 < light["prefix_hit_rate"] < 0.8
    no_sharing = Load(**{**load.__dict__, "shared_prefix_ratio": 0.0})
    assert simulate_replica(cost, 200_000, synthetic_trace(no_sharing, 1.0, 60, seed=0))["prefix_hit_rate"] == 0
    heavy = simulate_replica(cost, 200_000, synthetic_trace(load, 400.0, 60, seed=0))
    assert heavy["ttft"]["p99_ms"] > light["ttft"]["p99_ms"]
    # A KV pool too small for the longest request is reported, not simulated.
    assert not simulate_replica(cost, 64, synthetic_trace(load, 1.0, 10, seed=0))["feasible"]


def test_plan_picks_the_fewest_devices_that_meet_the_slo():
    load = Load(arrival_rate=20.0, prompt_len_median=512, output_len_median=64, max_model_len=2048)
    result = plan(MODEL, GPU, load, SLO(ttft_p99_ms=1500, tpot_p99_ms=60), num_requests=80)
    best = result["best"]
    assert best is not None and best["feasible"]
    feasible = [o for o in result["options"] if o["feasible"]]
    assert best["devices"] == min(o["devices"] for o in feasible)
    assert best["prediction"]["ttft"]["p99_ms"] <= 1500 and best["prediction"]["tpot"]["p99_ms"] <= 60
    # One replica fewer than chosen misses the SLO at that TP size.
    if best["replicas"] > 1:
        from kvserve.planner.plan import Workload, evaluate
        fewer = evaluate(MODEL, GPU, Workload(load, num_requests=80), best["tp"], best["replicas"] - 1,
                         StepCost(MODEL, GPU, best["tp"]))
        prediction = fewer["prediction"]
        assert prediction["ttft"]["p99_ms"] > 1500 or prediction["tpot"]["p99_ms"] > 60


def test_plan_command_on_a_config_json(tmp_path):
    config = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    completed = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "plan", "--model", str(tmp_path / "config.json"),
         "--memory-gib", "1", "--arrival-rate", "5", "--prompt-len", "128", "--output-len", "16",
         "--ttft-p99-ms", "500", "--tpot-p99-ms", "50", "--num-requests", "30", "--output-json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "best:" in completed.stdout
    assert json.loads(out.read_text())["best"]["replicas"] >= 1
    missing = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "--arrival-rate", "1"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "--ttft-p99-ms" in missing.stderr
