"""The plan's TP > 1 step cost: the collectives, the measured link, the fitted TP cost."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvserve.planner.calibrate import CalibratedStepCost, Calibration, StepSample, fit
from kvserve.planner.interconnect import (AllReduceSample, Interconnect, fit_interconnect, load_interconnect,
                                        measure_interconnect, ring_bytes)
from kvserve.planner.plan import Machine, ModelSpec, StepCost, tp_comm_seconds
from kvserve.planner.tp_cost import TPCost, fit_tp_cost, tp_gap, tp_step_cost, with_interconnect

MODEL = ModelSpec(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                  matmul_params=20_000_000, dtype_bytes=4, vocab_size=1000)
LINK = Interconnect(latency_s=400e-6, bandwidth_bytes_per_s=2e9)
MACHINE = with_interconnect(Machine(memory_gib=1, bandwidth_gbs=20, tflops=0.1), LINK)
ONE_RANK = Calibration(overhead_s=0.01, per_prefill_token_s=0.001, per_decode_token_s=0.004,
                       per_context_token_s=1e-6)
SHAPES = [("prefill", 32, 32), ("prefill", 128, 128), ("prefill", 384, 384), ("decode", 1, 44),
          ("decode", 4, 176), ("decode", 8, 352), ("decode", 4, 1584)]


def test_tp_collectives_by_hand():
    assert tp_comm_seconds(MODEL, MACHINE, 1, 64, 4) == 0.0
    # 2 per layer + the embedding's all-reduces, one logits gather, one token broadcast.
    tokens, sampled = 16, 3
    all_reduce = 400e-6 + 2 * (1 / 2) * tokens * 512 * 4 / 2e9
    gather = 400e-6 + (1 / 2) * sampled * 1000 * 4 / 2e9
    expected = 9 * all_reduce + gather + 400e-6
    assert tp_comm_seconds(MODEL, MACHINE, 2, tokens, sampled) == pytest.approx(expected, rel=1e-12)
    # Four ranks send 3/4 of the message twice around the ring instead of 1/2.
    at_4 = tp_comm_seconds(MODEL, MACHINE, 4, tokens, sampled)
    assert at_4 > tp_comm_seconds(MODEL, MACHINE, 2, tokens, sampled)
    # The roofline pays the same collectives on top of its split work.
    roofline_2 = StepCost(MODEL, MACHINE, 2).seconds(tokens, 100, 0, num_sampled=sampled)
    assert roofline_2 - tp_comm_seconds(MODEL, MACHINE, 2, tokens, sampled) == pytest.approx(
        StepCost(MODEL, MACHINE, 2).seconds(tokens, 100, 0) - tp_comm_seconds(MODEL, MACHINE, 2, tokens, 1))


def test_interconnect_fit_recovers_latency_and_bandwidth():
    samples = [AllReduceSample(size, LINK.allreduce_seconds(size, 2)) for size in (1024, 16384, 1 << 20, 1 << 22)]
    fitted = fit_interconnect(samples, world_size=2)
    assert fitted.latency_us == pytest.approx(400, rel=1e-6)
    assert fitted.bandwidth_gbs == pytest.approx(2.0, rel=1e-6)
    assert ring_bytes(1000, 4) == 1500
    # A link with no measurable byte cost gets a finite (JSON-safe) bandwidth, not a negative one.
    flat = fit_interconnect([AllReduceSample(1024, 1e-4), AllReduceSample(1 << 20, 1e-4)], world_size=2)
    assert flat.latency_us == pytest.approx(100) and 1e12 < flat.bandwidth_bytes_per_s < float("inf")
    assert Interconnect.from_json(json.loads(json.dumps(fitted.as_json()))).latency_us == pytest.approx(400)


def _tp_samples(dispatch_s: float, work_scale: float, tp: int) -> list[StepSample]:
    truth = CalibratedStepCost(ONE_RANK, tp, MODEL, MACHINE, dispatch_s, work_scale)
    return [StepSample(kind, n, ctx, truth.seconds(n, ctx, n if kind == "decode" else 0,
                                                   num_sampled=n if kind == "decode" else 1))
            for kind, n, ctx in SHAPES]


def test_tp_cost_fit_recovers_dispatch_and_work_scale():
    at_tp = Calibration(0, 0, 0, 0, tuple(_tp_samples(0.006, 1.3, 2)))
    cost = fit_tp_cost(ONE_RANK, at_tp, 2, MODEL, MACHINE, LINK)
    assert cost.dispatch_overhead_s == pytest.approx(0.006, rel=1e-6)
    assert cost.work_scale == pytest.approx(1.3, rel=1e-6)
    step = tp_step_cost(ONE_RANK, 2, MODEL, MACHINE, cost)
    for row in tp_gap(ONE_RANK, at_tp, step):
        assert row["tp_model_s"] == pytest.approx(row["seconds"], rel=1e-6)
        assert row["one_rank_s"] > 0
    # Without a TP measurement the step is the ideal split plus the collectives.
    ideal = tp_step_cost(ONE_RANK, 2, MODEL, MACHINE, None)
    assert ideal.seconds(8, 352, 8, num_sampled=8) == pytest.approx(
        0.01 + (8 * 0.004 + 352e-6) / 2 + tp_comm_seconds(MODEL, MACHINE, 2, 8, 8))
    assert tp_step_cost(ONE_RANK, 1, MODEL, MACHINE, cost).seconds(8, 352, 8) == pytest.approx(
        ONE_RANK.seconds(8, 352, 8))
    again = TPCost.from_json(json.loads(json.dumps(cost.as_json())))
    assert (again.tp, again.dispatch_overhead_s, again.work_scale) == (2, cost.dispatch_overhead_s, cost.work_scale)
    assert again.interconnect.latency_s == pytest.approx(LINK.latency_s)
    with pytest.raises(ValueError, match="tp >= 2"):
        fit_tp_cost(ONE_RANK, at_tp, 1, MODEL, MACHINE, LINK)


def _plan_check_json(tmp_path, config_json) -> str:
    """What `kvserve bench plan-check --tp 2` writes, from known costs."""
    from kvserve.planner.cli import model_shapes_from_path
    from dataclasses import asdict

    one_rank = fit([StepSample(kind, n, ctx, ONE_RANK.seconds(n, ctx, n if kind == "decode" else 0))
                    for kind, n, ctx in SHAPES])
    at_tp = Calibration(0, 0, 0, 0, tuple(_tp_samples(0.02, 1.5, 2)))
    cost = fit_tp_cost(one_rank, at_tp, 2, MODEL, MACHINE, LINK)
    shapes = asdict(model_shapes_from_path(str(config_json)))
    path = tmp_path / "plan-check-tp2.json"
    path.write_text(json.dumps({"result": {"calibration": {**one_rank.as_json(), "model_shapes": shapes},
                                           "interconnect": LINK.as_json(), "tp_cost": cost.as_json()}}))
    return str(path)


def test_plan_uses_the_measured_tp_cost_and_link(tmp_path):
    from kvserve.planner.cli import _calibrated_cost, _machine, model_shapes_from_path

    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps({"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
                                       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                                       "vocab_size": 1000}))
    calibration_json = _plan_check_json(tmp_path, config_json)
    args = argparse.Namespace(memory_gib=1.0, interconnect_gbs=None, interconnect_latency_us=None,
                              interconnect_json=None, calibration_json=calibration_json, devices_per_node=None,
                              memory_utilization=None, step_overhead_ms=None, roofline_json=None,
                              bandwidth_gbs=None, tflops=None, max_nodes_per_replica=None, inter_node_gbs=None,
                              inter_node_latency_us=None)
    machine = _machine(args)
    assert machine.interconnect_latency_us == pytest.approx(400) and machine.interconnect_gbs == pytest.approx(2)
    # An explicit flag still wins over the measured link.
    assert _machine(argparse.Namespace(**{**vars(args), "interconnect_gbs": 50.0})).interconnect_gbs == 50.0
    shapes = model_shapes_from_path(str(config_json))
    model = ModelSpec.from_shapes(shapes, 4)
    cost_for_tp = _calibrated_cost(calibration_json, shapes, model, machine)
    assert cost_for_tp(2).dispatch_overhead_s == pytest.approx(0.02, rel=1e-4)
    assert cost_for_tp(2).work_scale == pytest.approx(1.5, rel=1e-4)
    assert cost_for_tp(1).seconds(8, 352, 8) == pytest.approx(ONE_RANK.seconds(8, 352, 8), rel=1e-4)
    # The whole command: a fixed TP-2 fleet predicted with the measured TP cost.
    out = tmp_path / "plan.json"
    completed = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "--model", str(config_json),
                                "--dtype-bytes", "4", "--memory-gib", "1", "--calibration-json", calibration_json,
                                "--arrival-rate", "2", "--prompt-len", "64", "--output-len", "8",
                                "--num-requests", "20", "--tp", "2", "--replicas", "1", "--routing-policies", "",
                                "--ttft-p99-ms", "5000", "--tpot-p99-ms", "500", "--output-json", str(out)],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["machine"]["interconnect_latency_us"] == pytest.approx(400)
    assert result["best"]["tp"] == 2 and result["best"]["prediction"]["feasible"]
    assert "TP cost measured" in result["step_cost"]


@pytest.mark.slow
def test_interconnect_measured_on_loopback(tmp_path):
    link = measure_interconnect(2, sizes=(1024, 1 << 16), repeats=3)
    assert link.world_size == 2 and len(link.samples) == 2
    assert all(s.seconds > 0 for s in link.samples)
    assert link.latency_s >= 0 and link.bandwidth_bytes_per_s > 0
    path = tmp_path / "allreduce.json"
    path.write_text(json.dumps({"result": {"interconnect": link.as_json()}}))
    assert load_interconnect(str(path)).latency_us == pytest.approx(link.latency_us)
    with pytest.raises(ValueError, match="world_size >= 2"):
        measure_interconnect(1)


@pytest.mark.slow
def test_plan_check_at_tp_2_end_to_end(tmp_path):
    """One-rank and TP-2 servers of a tiny model: the TP cost is fitted and three predictions scored."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "tp"))
    from tp_helpers import save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "plan-check.json"
    command = [sys.executable, "-m", "kvserve.cli", "bench", "plan-check", "--model", model, "--tp", "2",
               "--num-requests", "6", "--arrival-rate", "2", "--prompt-len", "64", "--output-len", "6",
               "--num-shared-prefixes", "1", "--max-model-len", "256", "--output-json", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(out.read_text())["result"]
    assert result["measured"]["completed"] == 6
    assert "--tensor-parallel-size" in result["config"]["engine_flags"]
    for key in ("predicted", "predicted_ideal_split", "predicted_tp_server"):
        assert result[key]["feasible"] and result[f"{key}_over_measured"]["ttft_p50_ms"] > 0
    assert result["tp_cost"]["tp"] == 2 and result["tp_cost"]["work_scale"] >= 0
    assert result["interconnect"]["latency_us"] >= 0 and len(result["tp_samples"]) >= 4
    assert result["calibration"]["threads"] >= 1
    assert "ideal split's" in completed.stdout and "TP 2: all-reduce" in completed.stdout
    # The JSON plans TP 2 with the measured TP cost and link.
    plan = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "--model", model, "--dtype-bytes", "4",
                           "--memory-gib", "1", "--calibration-json", str(out), "--trace",
                           str(tmp_path / "plan-check.trace.jsonl"), "--tp", "2", "--replicas", "1",
                           "--routing-policies", "", "--ttft-p99-ms", "5000", "--tpot-p99-ms", "500"],
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    refused = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "plan-check", "--tp", "2",
                              "--num-requests", "2"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "does not divide" in refused.stderr and "random_model" in refused.stderr


@pytest.mark.slow
def test_random_model_has_the_default_size_and_splits_two_ways(tmp_path):
    from kvserve.bench.model_info import model_shapes, resolve_model_path
    from kvserve.bench.random_model import main
    from kvserve.worker.tp_executor import check_model_splits

    assert main(["--output-dir", str(tmp_path / "m"), "--num-layers", "1"]) == 0
    shapes = model_shapes(str(tmp_path / "m"))
    default = model_shapes(resolve_model_path(None))
    assert (shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.num_layers) == (8, 2, 64, 1)
    assert (shapes.hidden_size, shapes.intermediate_size, shapes.vocab_size) == (
        default.hidden_size, default.intermediate_size, default.vocab_size)
    check_model_splits(shapes, 2)
    assert (tmp_path / "m" / "tokenizer.json").exists()
    assert main(["--output-dir", str(tmp_path / "bad"), "--num-heads", "8", "--num-kv-heads", "3"]) == 2


@pytest.mark.parametrize("extra, message", [
    (["--arrival-rate", "1", "--tp", "2"], "--tp and --replicas go together"),
    (["--arrival-rate", "1", "--tp", "3", "--replicas", "1"], "--tp 3 does not split"),
    (["--arrival-rate", "0"], "--arrival-rate must be > 0"),
    (["--arrival-rate", "1", "--num-requests", "0"], "--num-requests must be >= 1"),
    (["--arrival-rate", "1", "--tpot-p99-ms", "-1"], "--tpot-p99-ms must be > 0"),
    (["--arrival-rate", "1", "--memory-gib", "0"], "--memory-gib must be > 0"),
    (["--arrival-rate", "1", "--shared-prefix-ratio", "1.5"], "are shares"),
    (["--arrival-rate", "1", "--block-size", "0"], "--block-size must be >= 1"),
    (["--arrival-rate", "1", "--prompt-len", "0"], "--prompt-len must be >= 1"),
    (["--arrival-rate", "1", "--interconnect-gbs", "0"], "--interconnect-gbs must be > 0"),
])
def test_plan_refuses_bad_flags_in_one_line(extra, message, capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "docs/examples/llama-70b-config.json", "--ttft-p99-ms", "2000",
              "--tpot-p99-ms", "60", *extra])
    assert message in str(exited.value.code) and "\n" not in str(exited.value.code)
    assert "Traceback" not in capsys.readouterr().err


def test_plan_refuses_an_unreadable_model_config(tmp_path):
    from kvserve.cli import main

    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    for path in (str(tmp_path / "config.json"), str(tmp_path / "missing.json")):
        with pytest.raises(SystemExit, match="not a readable model config.json"):
            main(["plan", "--model", path, "--arrival-rate", "1", "--ttft-p99-ms", "1", "--tpot-p99-ms", "1"])


@pytest.mark.parametrize("extra, message", [(["--tp", "0"], "--tp must be >= 1"),
                                            (["--num-requests", "0"], "--num-requests must be >= 1"),
                                            (["--arrival-rate", "-2"], "--arrival-rate must be > 0")])
def test_plan_check_refuses_bad_flags_before_starting_a_server(extra, message):
    from kvserve.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["bench", "plan-check", *extra])


def test_a_model_too_big_for_a_node_is_planned_with_tp_across_nodes():
    from kvserve.planner.plan import SLO, Load, format_result, plan

    # A 405B-like decoder in 16-bit: 810 GB of weights, more than 8 x 80 GiB at 90%.
    big = ModelSpec(num_layers=126, hidden_size=16384, num_heads=128, num_kv_heads=8, head_dim=128,
                    matmul_params=405_000_000_000, dtype_bytes=2, vocab_size=128256)
    one_node = Machine(memory_gib=80, bandwidth_gbs=3350, tflops=990)
    load = Load(arrival_rate=0.5, prompt_len_median=256, output_len_median=32, max_model_len=2048)
    slo = SLO(ttft_p99_ms=5000, tpot_p99_ms=200)
    alone = plan(big, one_node, load, slo, num_requests=20, routing_policies=())
    assert alone["best"] is None and [o["tp"] for o in alone["options"]] == [1, 2, 4, 8]
    assert "--max-nodes-per-replica 2" in format_result(alone)
    two_nodes = Machine(memory_gib=80, bandwidth_gbs=3350, tflops=990, max_nodes_per_replica=2,
                        inter_node_gbs=25, inter_node_latency_us=30)
    assert two_nodes.tp_sizes() == [1, 2, 4, 8, 16]
    spanning = plan(big, two_nodes, load, slo, num_requests=20, routing_policies=())
    best = spanning["best"]
    assert best["tp"] == 16 and best["nodes_per_replica"] == 2 and best["replicas"] == 1
    assert "kvserve serve --nnodes 2" in format_result(spanning)
    # Its collectives run at the network's speed, not the intra-node link's.
    assert tp_comm_seconds(big, two_nodes, 16, 64) > tp_comm_seconds(big, two_nodes, 8, 64) * 2
    assert Machine(1, 1, 1, devices_per_node=6, max_nodes_per_replica=3).tp_sizes() == [1, 2, 4, 6, 12, 18]
