"""`kvserve plan` inputs beyond the synthetic load: recorded traces, gateway routing, a measured step cost."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.planner.calibrate import CalibratedStepCost, Calibration, StepSample, fit, load_calibration
from kvserve.planner.plan import (Load, Machine, ModelSpec, SchedulerShape, StepCost, route, simulate_fleet,
                                simulate_replica, synthetic_trace)
from kvserve.bench.plan_check import compare
from kvserve.planner.trace import TraceError, TraceRequest, prompt_token_ids, read_trace, write_trace

MODEL = ModelSpec(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                  matmul_params=7_000_000_000, dtype_bytes=2)
GPU = Machine(memory_gib=80, bandwidth_gbs=3350, tflops=990)
CALIBRATION = Calibration(overhead_s=0.02, per_prefill_token_s=0.0005, per_decode_token_s=0.004,
                          per_context_token_s=2e-6)


def _samples(calibration: Calibration) -> list[StepSample]:
    points = [("prefill", 32, 32), ("prefill", 128, 128), ("prefill", 384, 384), ("decode", 1, 44),
              ("decode", 4, 176), ("decode", 8, 352), ("decode", 4, 1584)]
    return [StepSample(kind, n, ctx, calibration.seconds(n, ctx, n if kind == "decode" else 0))
            for kind, n, ctx in points]


def test_fit_recovers_known_coefficients_and_never_goes_negative():
    fitted = fit(_samples(CALIBRATION))
    for name in ("overhead_s", "per_prefill_token_s", "per_decode_token_s", "per_context_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(CALIBRATION, name), rel=1e-6)
    # A context term that would come out negative is dropped, not fitted below zero.
    noisy = [StepSample(s.kind, s.num_tokens, s.num_context_tokens,
                        s.seconds - 3e-6 * s.num_context_tokens * (s.kind == "decode"))
             for s in _samples(CALIBRATION)]
    refit = fit(noisy)
    assert min(refit.overhead_s, refit.per_prefill_token_s, refit.per_decode_token_s,
               refit.per_context_token_s) >= 0
    with pytest.raises(ValueError, match="at least 4 samples"):
        fit(_samples(CALIBRATION)[:3])


def test_calibrated_cost_splits_work_over_tp_and_adds_all_reduces(tmp_path):
    one = CalibratedStepCost(CALIBRATION)
    assert one.seconds(8, 352, 8) == pytest.approx(0.02 + 8 * 0.004 + 352 * 2e-6)
    two = CalibratedStepCost(CALIBRATION, 2, MODEL, GPU)
    assert (one.seconds(8, 352, 8) - 0.02) / 2 < two.seconds(8, 352, 8) - 0.02 < one.seconds(8, 352, 8) - 0.02
    path = tmp_path / "plan-check.json"
    path.write_text(json.dumps({"result": {"calibration": fit(_samples(CALIBRATION)).as_json()}}))
    assert load_calibration(str(path)).per_decode_token_s == pytest.approx(0.004)


def test_trace_round_trip_and_bad_lines(tmp_path):
    trace = [TraceRequest(0.0, 10, 3, "sys-a", 6), TraceRequest(0.5, 8, 2),
             TraceRequest(0.5, 4, 1, prompt_token_ids=(1001, 1002, 1003, 1004))]
    path = write_trace(str(tmp_path / "t.jsonl"), trace)
    assert read_trace(path) == trace
    for line, message in [('{"arrival_s": 1, "output_len": 2}', "prompt_len"),
                          ('{"arrival_s": 1, "prompt_len": 4, "output_len": 0}', "lengths must be >= 1"),
                          ('{"arrival_s": 1, "prompt_len": 4, "output_len": 2, "prefix_len": 9}', "prefix_len 9"),
                          ("not json", "line 1")]:
        (tmp_path / "bad.jsonl").write_text(line + "\n")
        with pytest.raises(TraceError, match=message):
            read_trace(str(tmp_path / "bad.jsonl"))
    (tmp_path / "late.jsonl").write_text('{"arrival_s": 2, "prompt_len": 4, "output_len": 1}\n'
                                         '{"arrival_s": 1, "prompt_len": 4, "output_len": 1}\n')
    with pytest.raises(TraceError, match="non-decreasing"):
        read_trace(str(tmp_path / "late.jsonl"))


def test_made_up_prompts_share_exactly_their_prefix():
    trace = [TraceRequest(0, 20, 1, "a", 12), TraceRequest(1, 16, 1, "a", 8), TraceRequest(2, 20, 1, "b", 12),
             TraceRequest(3, 20, 1)]
    a_long, a_short, b, plain = prompt_token_ids(trace, vocab_size=50_000)
    assert [len(p) for p in (a_long, a_short, b, plain)] == [20, 16, 20, 20]
    assert a_short[:8] == a_long[:8] and a_short[8] != a_long[8]
    assert b[0] != a_long[0] and plain[:12] != a_long[:12]


def test_cache_aware_routing_keeps_each_prefix_on_one_replica_and_hits_more():
    load = Load(arrival_rate=40.0, prompt_len_median=600, prompt_len_sigma=0.2, output_len_median=8,
                shared_prefix_ratio=0.8, num_shared_prefixes=8, max_model_len=2048)
    trace = synthetic_trace(load, load.arrival_rate, 240, seed=0)
    spread = route(trace, 4, "cache_aware")
    owners = {}
    for replica, indices in enumerate(spread):
        for index in indices:
            assert owners.setdefault(trace[index].prefix_id, replica) == replica
    assert [len(i) for i in route(trace, 4, "round_robin")] == [60] * 4
    # KV for about three prefixes per replica: round-robin thrashes, cache-aware keeps its two.
    cost = StepCost(MODEL, GPU, 1)
    shape = SchedulerShape(block_size=16, max_num_seqs=16, max_num_batched_tokens=4096)
    by_policy = {policy: simulate_fleet(cost, 2400, trace, 4, policy, shape=shape)
                 for policy in ("round_robin", "cache_aware")}
    assert by_policy["cache_aware"]["prefix_hit_rate"] > by_policy["round_robin"]["prefix_hit_rate"] + 0.1
    with pytest.raises(ValueError, match="unknown routing policy"):
        route(trace, 2, "fastest")


def test_a_large_fleet_is_simulated_as_a_slice_with_the_same_load_per_replica():
    load = Load(arrival_rate=64.0, prompt_len_median=64, output_len_median=8, num_shared_prefixes=64)
    trace = synthetic_trace(load, load.arrival_rate, 3200, seed=1)
    result = simulate_fleet(CalibratedStepCost(CALIBRATION), 100_000, trace, 64, "round_robin")
    assert result["simulated_replicas"] == 8
    assert 300 < sum(result["requests_per_simulated_replica"]) < 500  # an eighth of the fleet's 3,200


def test_compare_is_predicted_over_measured():
    predicted = {"ttft": {"p50_ms": 100, "p99_ms": 300}, "tpot": {"p50_ms": 20, "p99_ms": 40}, "prefix_hit_rate": 0.5}
    measured = {"ttft": {"p50_ms": 200, "p99_ms": 300}, "tpot": {"p50_ms": 10, "p99_ms": 0}, "prefix_hit_rate": 0.25}
    assert compare(predicted, measured) == {"ttft_p50_ms": 0.5, "ttft_p99_ms": 1.0, "tpot_p50_ms": 2.0,
                                            "tpot_p99_ms": None, "prefix_hit_rate": 2.0}


def test_plan_command_with_a_trace_and_a_calibration(tmp_path):
    config = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    load = Load(arrival_rate=4.0, prompt_len_median=128, output_len_median=16, num_shared_prefixes=2)
    write_trace(str(tmp_path / "trace.jsonl"), synthetic_trace(load, 4.0, 60, seed=0))
    (tmp_path / "cal.json").write_text(json.dumps({"calibration": fit(_samples(CALIBRATION)).as_json()}))
    out = tmp_path / "plan.json"
    base = [sys.executable, "-m", "kvserve.cli", "plan", "--model", str(tmp_path / "config.json"),
            "--memory-gib", "1", "--ttft-p99-ms", "2000", "--tpot-p99-ms", "100"]
    completed = subprocess.run([*base, "--trace", str(tmp_path / "trace.jsonl"), "--calibration-json",
                                str(tmp_path / "cal.json"), "--output-json", str(out)],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["trace_requests"] == 60 and result["step_cost"].startswith("calibrated")
    assert set(result["best"]["routing"]) == {"round_robin", "cache_aware"}
    assert "behind the gateway" in completed.stdout
    neither = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert neither.returncode != 0 and "--arrival-rate" in neither.stderr and "--trace" in neither.stderr
    other_model = {**fit(_samples(CALIBRATION)).as_json(), "model_shapes": {"hidden_size": 64}}
    (tmp_path / "other.json").write_text(json.dumps({"result": {"calibration": other_model}}))
    refused = subprocess.run([*base, "--arrival-rate", "1", "--calibration-json", str(tmp_path / "other.json")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "measured on a model of shapes" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_plan_check_also_scores_the_roofline_on_the_same_trace(tmp_path):
    from kvserve.bench.plan_check import PlanCheckConfig, _roofline_prediction, format_result

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps({"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
                                       "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000}))
    roofline = tmp_path / "roofline.json"
    roofline.write_text(json.dumps({"result": {"by_dtype": {"float32": {"matmul": [
        {"m": 1, "weight_read_gb_per_s": 20.0, "gflops": 10.0},
        {"m": 256, "weight_read_gb_per_s": 50.0, "gflops": 200.0}]}}}}))
    config = PlanCheckConfig(model=str(config_json), roofline_json=str(roofline))
    trace = synthetic_trace(Load(arrival_rate=1.0, prompt_len_median=64, output_len_median=8), 1.0, 20, seed=0)
    calibration = fit(_samples(CALIBRATION))
    measured = simulate_replica(CalibratedStepCost(calibration), 5000, trace)
    scored = _roofline_prediction(config, calibration, 5000, trace, measured)
    assert scored["machine"]["tflops"] == pytest.approx(0.2) and scored["machine"]["bandwidth_gbs"] == 20.0
    assert scored["predicted"]["feasible"] and set(scored["predicted_over_measured"]) >= {"ttft_p99_ms"}
    assert len(scored["samples"]) == 7 and all(s["measured_over_roofline"] > 0 for s in scored["samples"])
    result = {"calibration": calibration.as_json(), "kv_capacity_tokens": 5000, "trace_requests": 20,
              "predicted": measured, "measured": {**measured, "completed": 20, "failed": 0},
              "predicted_over_measured": compare(measured, measured), "roofline": scored}
    text = format_result(result)
    assert "roofline's predicted/measured" in text and "1.00x" in text


def test_a_simulated_replica_takes_decode_heavy_steps_at_the_decode_rate():
    trace = [TraceRequest(0.0, 64, 11)]
    result = simulate_replica(CalibratedStepCost(CALIBRATION), 10_000, trace)
    # One prefill step of 64 tokens, then ten decode steps of one token each.
    prefill_s = CALIBRATION.seconds(64, 64)
    assert result["ttft"]["p50_ms"] == pytest.approx(1000 * prefill_s, rel=1e-6)
    decode_s = [CALIBRATION.seconds(1, 65 + i, 1) for i in range(10)]
    assert result["tpot"]["p50_ms"] == pytest.approx(1000 * sum(decode_s) / 10, rel=1e-6)


@pytest.mark.slow
def test_plan_check_end_to_end_on_the_default_model(tmp_path):
    out = tmp_path / "plan-check.json"
    command = [sys.executable, "-m", "kvserve.cli", "bench", "plan-check", "--num-requests", "6",
               "--arrival-rate", "2", "--prompt-len", "64", "--output-len", "6", "--num-shared-prefixes", "1",
               "--output-json", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(out.read_text())["result"]
    assert result["measured"]["completed"] == 6 and result["predicted"]["feasible"]
    assert result["measured"]["prefix_hit_rate"] > 0 and result["predicted"]["prefix_hit_rate"] > 0
    assert len(read_trace(str(tmp_path / "plan-check.trace.jsonl"))) == 6
    assert load_calibration(str(out)).overhead_s >= 0
    assert "predicted/measured" in completed.stdout
