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
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.calibrate import completion_body, measure
from kvserve.bench.plan import Load, SchedulerShape, simulate_replica, synthetic_trace
from kvserve.bench.report import LatencyStats, format_table
from kvserve.bench.trace import TraceRequest, prompt_token_ids, read_trace, write_trace

SERVED_MODEL = "plan-check"


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

    def engine_flags(self) -> list[str]:
        flags = ["--max-model-len", str(self.max_model_len), "--kv-cache-memory", self.kv_cache_memory,
                 "--block-size", str(self.shape.block_size), "--max-num-seqs", str(self.shape.max_num_seqs),
                 "--max-num-batched-tokens", str(self.shape.max_num_batched_tokens), *self.extra_flags]
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


def run(config: PlanCheckConfig) -> dict[str, Any]:
    """Start a server, calibrate, predict, measure, compare (see the module docstring)."""
    from kvserve.bench.calibrate import CalibratedStepCost
    from kvserve.bench.model_info import model_shapes, resolve_model_path
    from kvserve.bench.replicas import _get_json, start_replica

    trace = _trace(config)
    shapes = model_shapes(resolve_model_path(config.model))
    vocab_size = shapes.vocab_size
    prompts = prompt_token_ids(trace, vocab_size, config.seed)
    if config.trace_out:
        Path(config.trace_out).parent.mkdir(parents=True, exist_ok=True)
        write_trace(config.trace_out, [TraceRequest(r.arrival_s, r.prompt_len, r.output_len, r.prefix_id,
                                                    r.prefix_len) for r in trace])
    replica = start_replica(0, SERVED_MODEL, config.engine_flags(), threads=config.threads)
    try:
        info = _get_json(replica.url + "/server_info")
        started = time.perf_counter()
        calibration = asyncio.run(measure(replica.url, SERVED_MODEL, vocab_size,
                                          max_model_len=config.max_model_len, seed=config.seed + 1))
        calibration_s = time.perf_counter() - started
        measured = asyncio.run(replay(replica.url, trace, prompts))
    finally:
        replica.stop()
    kv_tokens = int(info["max_total_num_tokens"])
    predicted = simulate_replica(CalibratedStepCost(calibration), kv_tokens, trace, shape=config.shape,
                                 seed=config.seed)
    result = {"config": {**asdict(config), "engine_flags": config.engine_flags()},
              "kv_capacity_tokens": kv_tokens, "trace_requests": len(trace), "trace_path": config.trace_out,
              "calibration": {**calibration.as_json(), "model_shapes": asdict(shapes)},
              "calibration_s": calibration_s,
              "predicted": predicted, "measured": measured,
              "predicted_over_measured": compare(predicted, measured) if predicted["feasible"] else None}
    if config.roofline_json:
        result["roofline"] = _roofline_prediction(config, calibration, kv_tokens, trace, measured)
    return result


def _roofline_prediction(config: PlanCheckConfig, calibration, kv_tokens: int, trace: list[TraceRequest],
                         measured: dict[str, Any]) -> dict[str, Any]:
    """The same trace with the roofline's step cost (`kvserve bench roofline` of this machine),
    and each calibration sample's measured time over the roofline's."""
    from kvserve.bench.calibrate import roofline_gap
    from kvserve.bench.plan import StepCost, machine_from_roofline
    from kvserve.bench.plan_cli import model_spec_from_path

    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.roofline_dtype]
    # Memory does not matter here: the KV pool is the server's.
    machine = machine_from_roofline(config.roofline_json, config.roofline_dtype, memory_gib=1.0)
    model = model_spec_from_path(config.model, dtype_bytes)
    predicted = simulate_replica(StepCost(model, machine, 1), kv_tokens, trace, shape=config.shape, seed=config.seed)
    return {"machine": asdict(machine), "dtype": config.roofline_dtype, "predicted": predicted,
            "predicted_over_measured": compare(predicted, measured) if predicted["feasible"] else None,
            "samples": roofline_gap(calibration, model, machine)}


def format_result(result: dict[str, Any]) -> str:
    calibration = result["calibration"]
    predicted, measured = result["predicted"], result["measured"]
    header = (f"calibrated step: {1000 * calibration['overhead_s']:.1f} ms + "
              f"{1e6 * calibration['per_prefill_token_s']:.1f} us/prefill token + "
              f"{1e6 * calibration['per_decode_token_s']:.1f} us/decode token + "
              f"{1e9 * calibration['per_context_token_s']:.1f} ns/context token "
              f"(KV capacity {result['kv_capacity_tokens']} tokens)")
    if not predicted["feasible"]:
        return header + f"\nno prediction: {predicted['reason']}"
    ratios = result["predicted_over_measured"]
    roofline = result.get("roofline") or {}
    roofline_ratios = roofline.get("predicted_over_measured") or {}
    rows = []
    for key, label in (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
                       ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms")):
        metric, pct = key.split("_", 1)
        rows.append([label, predicted[metric][pct], measured[metric][pct], _ratio(ratios[key])])
        if roofline:
            rows[-1].append(_ratio(roofline_ratios.get(key)))
    rows.append(["prefix-hit rate", f"{100 * predicted['prefix_hit_rate']:.1f}%",
                 f"{100 * measured['prefix_hit_rate']:.1f}%", _ratio(ratios["prefix_hit_rate"])])
    headers = ["figure", "predicted", "measured", "predicted/measured"]
    if roofline:
        rows[-1].append(_ratio(roofline_ratios.get("prefix_hit_rate")))
        headers.append("roofline's predicted/measured")
    table = format_table(headers, rows,
                         title=f"plan-check: {result['trace_requests']} requests, "
                               f"{measured['completed']} completed, {measured['failed']} failed")
    return header + "\n\n" + table


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def trace_path_next_to(json_path: str | Path) -> str:
    """Where the replayed trace goes by default: beside the JSON, `.trace.jsonl`."""
    return str(Path(json_path).with_suffix(".trace.jsonl"))
