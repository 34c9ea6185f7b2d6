"""`kvserve bench plan-check`: `kvserve plan`'s prediction against a measured run, same trace.

1. Start one `kvserve serve` on loopback with the given flags.
2. Calibrate the step-cost model on it (`calibrate.measure`).
3. Take the trace (recorded JSONL, or synthetic from the load flags) and write it
   next to the JSON, in the format `kvserve plan --trace` reads.
4. Predict: the trace through the real scheduler and KV manager on a simulated
   clock, with the server's KV capacity and scheduler limits and the calibrated cost.
5. Measure: replay the trace against the server at its arrival times (the
   prompts as token ids, so prefix sharing is exact) and read the server's own
   prefix-cache counters.
6. Report both and their ratio (predicted / measured) for TTFT and TPOT p50/p99
   and the prefix-hit rate.

With `tp` > 1 the prediction is the one `kvserve plan` makes for TP > 1: a
one-rank server (torch threads: one rank's share of the cores) is calibrated
first, all-reduces between `tp` processes are timed on loopback, then the
`-tp` server is calibrated and replays the trace. The TP server's samples fit
the TP cost (kvserve/planner/tp_cost.py) and three predictions are scored: the
ideal split (one-rank work / tp + the measured collectives), the TP model
(with the fitted dispatch overhead and work scale), and the TP server's own
calibration.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve.planner.calibrate import completion_body, measure
from kvserve.planner.plan import Load, SchedulerShape, simulate_replica, synthetic_trace
from kvserve.bench.report import LatencyStats, format_table
from kvserve.planner.trace import TraceRequest, prompt_token_ids, read_trace, write_trace

SERVED_MODEL = "plan-check"
# `kvserve bench plan-check` flags and their lowest values (see plan_cli.check_bounds).
FLAG_BOUNDS = (("tp", 1, True), ("num_requests", 1, True), ("arrival_rate", 0, False), ("prompt_len", 1, True),
               ("output_len", 1, True), ("len_sigma", 0, True), ("shared_prefix_ratio", 0, True),
               ("num_shared_prefixes", 0, True), ("max_model_len", 2, True), ("block_size", 1, True),
               ("max_num_seqs", 1, True), ("max_num_batched_tokens", 1, True), ("activation_bytes", 1, True),
               ("server_threads", 0, True))


@dataclass(frozen=True)
class PlanCheckConfig:
    """What to start, the traffic to send, and where the trace goes."""

    model: str | None = None
    kv_cache_memory: str = "64MiB"
    max_model_len: int = 1024
    shape: SchedulerShape = SchedulerShape(block_size=16, max_num_seqs=64, max_num_batched_tokens=2048)
    load: Load = Load(arrival_rate=1.0, prompt_len_median=192, output_len_median=24, shared_prefix_ratio=0.5,
                      num_shared_prefixes=4, max_model_len=1024)
    num_requests: int = 40
    trace_path: str | None = None
    trace_out: str | None = None
    seed: int = 0
    threads: int | None = None
    extra_flags: tuple[str, ...] = ()
    roofline_json: str | None = None
    roofline_dtype: str = "float32"
    tp: int = 1
    activation_bytes: int = 4

    def engine_flags(self, tp: int | None = None) -> list[str]:
        flags = ["--max-model-len", str(self.max_model_len), "--kv-cache-memory", self.kv_cache_memory,
                 "--block-size", str(self.shape.block_size), "--max-num-seqs", str(self.shape.max_num_seqs),
                 "--max-num-batched-tokens", str(self.shape.max_num_batched_tokens), *self.extra_flags]
        tp = self.tp if tp is None else tp
        if tp > 1:
            flags += ["--tensor-parallel-size", str(tp)]
        return (["--model", self.model] if self.model else []) + flags


async def replay(base_url: str, trace: list[TraceRequest], prompts: list[list[int]]) -> dict[str, Any]:
    """Send every request at its arrival time; latencies and the server's prefix-cache counters."""
    import httpx

    from kvserve.bench.route import parse_counters
    from kvserve.bench.serve import stream_one

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=len(trace), max_keepalive_connections=len(trace))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0), trust_env=False) as client:
        before = parse_counters((await client.get(base_url + "/metrics")).text)
        started = time.perf_counter()

        async def one(request: TraceRequest, prompt: list[int]):
            await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - started)))
            return await stream_one(client, url, completion_body(SERVED_MODEL, prompt, request.output_len), {})

        results = await asyncio.gather(*(one(r, p) for r, p in zip(trace, prompts)))
        duration_s = time.perf_counter() - started
        await asyncio.sleep(1.5)  # the metrics snapshot trails the last step
        after = parse_counters((await client.get(base_url + "/metrics")).text)
    ok = [r for r in results if r.ok]
    queries = after.prefix_queries - before.prefix_queries
    return {"num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration_s,
            "prefix_hit_rate": (after.prefix_hits - before.prefix_hits) / queries if queries else 0.0,
            "ttft": LatencyStats.from_seconds([r.ttft_s for r in ok]).as_dict(),
            "tpot": LatencyStats.from_seconds([r.tpot_s for r in ok if r.tpot_s is not None]).as_dict()}


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    """predicted / measured for each figure (1.0 is a perfect prediction)."""
    ratios: dict[str, float | None] = {}
    for metric in ("ttft", "tpot"):
        for pct in ("p50_ms", "p99_ms"):
            got = measured[metric][pct]
            ratios[f"{metric}_{pct}"] = predicted[metric][pct] / got if got else None
    got = measured["prefix_hit_rate"]
    ratios["prefix_hit_rate"] = predicted["prefix_hit_rate"] / got if got else None
    return ratios


def _trace(config: PlanCheckConfig) -> list[TraceRequest]:
    if config.trace_path:
        return read_trace(config.trace_path)
    return synthetic_trace(config.load, config.load.arrival_rate, config.num_requests, config.seed)


def _calibrate_server(config: PlanCheckConfig, vocab_size: int, tp: int, threads: int | None,
                      trace: list[TraceRequest] | None = None, prompts: list[list[int]] | None = None):
    """Start a server at `tp`, calibrate it (and replay the trace when given), stop it."""
    from kvserve.bench.replicas import _get_json, start_replica

    replica = start_replica(0, SERVED_MODEL, config.engine_flags(tp), threads=threads)
    try:
        info = _get_json(replica.url + "/server_info")
        started = time.perf_counter()
        calibration = asyncio.run(measure(replica.url, SERVED_MODEL, vocab_size,
                                          max_model_len=config.max_model_len, seed=config.seed + 1))
        calibration_s = time.perf_counter() - started
        measured = asyncio.run(replay(replica.url, trace, prompts)) if trace is not None else None
    finally:
        replica.stop()
    return int(info["max_total_num_tokens"]), calibration, calibration_s, measured


def run(config: PlanCheckConfig) -> dict[str, Any]:
    """Start a server, calibrate, predict, measure, compare (see the module docstring)."""
    from kvserve.planner.calibrate import CalibratedStepCost
    from kvserve.bench.model_info import model_shapes, resolve_model_path

    trace = _trace(config)
    shapes = model_shapes(resolve_model_path(config.model))
    if config.tp > 1:
        _check_splits(shapes, config.tp)
    prompts = prompt_token_ids(trace, shapes.vocab_size, config.seed)
    if config.trace_out:
        Path(config.trace_out).parent.mkdir(parents=True, exist_ok=True)
        write_trace(config.trace_out, [TraceRequest(r.arrival_s, r.prompt_len, r.output_len, r.prefix_id,
                                                    r.prefix_len) for r in trace])
    tp_part: dict[str, Any] = {}
    if config.tp > 1:
        tp_part = _one_rank_and_link(config, shapes.vocab_size)
    kv_tokens, calibration, calibration_s, measured = _calibrate_server(
        config, shapes.vocab_size, config.tp, config.threads, trace, prompts)
    predicted = simulate_replica(CalibratedStepCost(calibration), kv_tokens, trace, shape=config.shape,
                                 seed=config.seed) if not tp_part else {"feasible": False}
    result = {"config": {**asdict(config), "engine_flags": config.engine_flags()},
              "kv_capacity_tokens": kv_tokens, "trace_requests": len(trace), "trace_path": config.trace_out,
              "calibration": {**calibration.as_json(), "model_shapes": asdict(shapes)},
              "calibration_s": calibration_s,
              "predicted": predicted, "measured": measured,
              "predicted_over_measured": compare(predicted, measured) if predicted["feasible"] else None}
    if tp_part:  # replaces calibration, predicted and predicted_over_measured
        tp_part["tp_server_calibration_s"] = calibration_s
        result.update(_tp_predictions(config, shapes, tp_part, calibration, kv_tokens, trace, measured))
    if config.roofline_json:
        one_rank = tp_part["one_rank"] if tp_part else calibration
        link = tp_part["interconnect"] if tp_part else None
        result["roofline"] = _roofline_prediction(config, one_rank, kv_tokens, trace, measured, link)
    return result


def _check_splits(shapes, tp: int) -> None:
    """A model TP cannot split is refused before any server starts."""
    from kvserve.config import ConfigError
    from kvserve.worker.tp_executor import check_model_splits

    try:
        check_model_splits(shapes, tp)  # reads only the head counts and the MLP width
    except ConfigError as exc:
        raise ValueError(f"--tp {tp}: {exc} (python3 -m kvserve.bench.random_model writes a model "
                         "of the default one's size that splits 2 ways)") from None


def _one_rank_and_link(config: PlanCheckConfig, vocab_size: int) -> dict[str, Any]:
    """The one-rank calibration (one rank's share of the cores) and the measured all-reduce."""
    from kvserve.planner.interconnect import measure_interconnect
    from kvserve.worker.tp_executor import threads_per_rank

    threads = threads_per_rank(config.tp)
    _, one_rank, one_rank_s, _ = _calibrate_server(config, vocab_size, 1, threads)
    return {"one_rank": one_rank, "one_rank_s": one_rank_s, "one_rank_threads": threads,
            "interconnect": measure_interconnect(config.tp)}


def _tp_predictions(config: PlanCheckConfig, shapes, tp_part: dict[str, Any], at_tp, kv_tokens: int,
                    trace: list[TraceRequest], measured: dict[str, Any]) -> dict[str, Any]:
    """The TP cost fit and the ideal-split and TP-model predictions of the same trace.
    `calibration` becomes the one-rank one (what `kvserve plan` scales) and `predicted` the TP
    model's (what `kvserve plan` predicts); the TP server's own calibration and its prediction
    move to `tp_server_calibration` and `predicted_tp_server`."""
    from kvserve.planner.calibrate import CalibratedStepCost
    from kvserve.planner.plan import Machine, ModelSpec
    from kvserve.planner.tp_cost import fit_tp_cost, tp_gap, with_interconnect

    one_rank, interconnect = tp_part["one_rank"], tp_part["interconnect"]
    model = ModelSpec.from_shapes(shapes, config.activation_bytes)
    machine = with_interconnect(Machine(memory_gib=1.0, bandwidth_gbs=1.0, tflops=1.0), interconnect)
    tp_cost = fit_tp_cost(one_rank, at_tp, config.tp, model, machine, interconnect)
    at_tp_s = tp_part["tp_server_calibration_s"]
    ideal = CalibratedStepCost(one_rank, config.tp, model, machine)
    modelled = CalibratedStepCost(one_rank, config.tp, model, machine, tp_cost.dispatch_overhead_s,
                                  tp_cost.work_scale)
    out: dict[str, Any] = {"tp_server_calibration": {**at_tp.as_json(), "model_shapes": asdict(shapes)},
                           "tp_server_calibration_s": at_tp_s,
                           "calibration": {**one_rank.as_json(), "model_shapes": asdict(shapes),
                                           "threads": tp_part["one_rank_threads"]},
                           "calibration_s": tp_part["one_rank_s"],
                           "interconnect": interconnect.as_json(), "tp_cost": tp_cost.as_json(),
                           "tp_samples": tp_gap(one_rank, at_tp, modelled)}
    out["predicted_tp_server"] = simulate_replica(CalibratedStepCost(at_tp), kv_tokens, trace, shape=config.shape,
                                                  seed=config.seed)
    for key, cost in (("_ideal_split", ideal), ("", modelled)):
        predicted = simulate_replica(cost, kv_tokens, trace, shape=config.shape, seed=config.seed)
        out[f"predicted{key}"] = predicted
    for key in ("_tp_server", "_ideal_split", ""):
        predicted = out[f"predicted{key}"]
        out[f"predicted{key}_over_measured"] = compare(predicted, measured) if predicted["feasible"] else None
    return out


def _roofline_prediction(config: PlanCheckConfig, calibration, kv_tokens: int, trace: list[TraceRequest],
                         measured: dict[str, Any], interconnect=None) -> dict[str, Any]:
    """The same trace with the roofline's step cost (`kvserve bench roofline` of this machine, at
    `config.tp` over the measured `interconnect`), and each one-rank calibration sample's measured
    time over the roofline's."""
    from kvserve.planner.calibrate import roofline_gap
    from kvserve.planner.plan import StepCost, machine_from_roofline
    from kvserve.planner.cli import model_spec_from_path

    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.roofline_dtype]
    # Memory does not matter here: the KV pool is the server's.
    machine = machine_from_roofline(config.roofline_json, config.roofline_dtype, memory_gib=1.0)
    if interconnect is not None:
        from kvserve.planner.tp_cost import with_interconnect
        machine = with_interconnect(machine, interconnect)
    model = model_spec_from_path(config.model, dtype_bytes)
    predicted = simulate_replica(StepCost(model, machine, config.tp), kv_tokens, trace, shape=config.shape,
                                 seed=config.seed)
    return {"machine": asdict(machine), "dtype": config.roofline_dtype, "predicted": predicted,
            "predicted_over_measured": compare(predicted, measured) if predicted["feasible"] else None,
            "samples": roofline_gap(calibration, model, machine)}


def format_result(result: dict[str, Any]) -> str:
    calibration = result["calibration"]
    predicted, measured = result["predicted"], result["measured"]
    one_rank = " (one rank)" if "tp_cost" in result else ""
    header = (f"calibrated step{one_rank}: {1000 * calibration['overhead_s']:.1f} ms + "
              f"{1e6 * calibration['per_prefill_token_s']:.1f} us/prefill token + "
              f"{1e6 * calibration['per_decode_token_s']:.1f} us/decode token + "
              f"{1e9 * calibration['per_context_token_s']:.1f} ns/context token "
              f"(KV capacity {result['kv_capacity_tokens']} tokens)")
    if "tp_cost" in result:
        tp_cost, link = result["tp_cost"], result["interconnect"]
        header += (f"\nTP {tp_cost['tp']}: all-reduce {link['latency_us']:.0f} us + bytes at "
                   f"{link['bandwidth_gbs']:.2f} GB/s ({link['backend']}); dispatch "
                   f"{1000 * tp_cost['dispatch_overhead_s']:.1f} ms/step; work per rank "
                   f"{tp_cost['work_scale']:.2f}x of 1/{tp_cost['tp']}")
    if not predicted["feasible"]:
        return header + f"\nno prediction: {predicted['reason']}"
    extra = [(title, (result.get(key) or {}).get("predicted_over_measured") if key == "roofline"
              else result.get(key)) for key, title in _EXTRA_COLUMNS if result.get(key)]
    ratios = result["predicted_over_measured"]
    rows = []
    for key, label in (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
                       ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
                       ("prefix_hit_rate", "prefix-hit rate")):
        if key == "prefix_hit_rate":
            row = [label, f"{100 * predicted[key]:.1f}%", f"{100 * measured[key]:.1f}%"]
        else:
            metric, pct = key.split("_", 1)
            row = [label, predicted[metric][pct], measured[metric][pct]]
        rows.append(row + [_ratio(ratios[key])] + [_ratio((r or {}).get(key)) for _, r in extra])
    headers = ["figure", "predicted", "measured", "predicted/measured"] + [title for title, _ in extra]
    table = format_table(headers, rows,
                         title=f"plan-check: {result['trace_requests']} requests, "
                               f"{measured['completed']} completed, {measured['failed']} failed")
    return header + "\n\n" + table


# Other predictions of the same trace, as predicted/measured columns.
_EXTRA_COLUMNS = (("predicted_ideal_split_over_measured", "ideal split's"),
                  ("predicted_tp_server_over_measured", "TP server's calibration's"),
                  ("roofline", "roofline's predicted/measured"))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def trace_path_next_to(json_path: str | Path) -> str:
    """Where the replayed trace goes by default: beside the JSON, `.trace.jsonl`."""
    return str(Path(json_path).with_suffix(".trace.jsonl"))
