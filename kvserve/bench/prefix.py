"""Prefix caching: many requests sharing a long system prompt, each with its own question.

Three engines run the same workload, one after the other:
- `off`: prefix caching disabled;
- `on`: caching with hashes per block (`hash_block_size == block_size`);
- `on, partial blocks`: hashes every `partial_hash_block_size` tokens, so a
  prefix that ends inside a block still hits (the hit block is copied).

The first request fills the cache ("cold"); the others are sent one at a
time so each TTFT is prefill work only, never queueing behind another request.
The default prefix length is deliberately not a multiple of the block size.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from kvserve.bench.report import LatencyStats, format_table
from kvserve.bench.workloads import Workload


def _configurations(block_size: int, partial_hash_block_size: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("off", {"enable_prefix_caching": False, "block_size": block_size}),
        ("on", {"enable_prefix_caching": True, "block_size": block_size, "hash_block_size": block_size}),
        (f"on, partial blocks (hash every {partial_hash_block_size})",
         {"enable_prefix_caching": True, "block_size": block_size, "hash_block_size": partial_hash_block_size}),
    ]


def _run_one_engine(workload: Workload, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    try:
        def send(request) -> tuple[float, int]:
            params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
            output = llm.generate([{"prompt_token_ids": request.prompt_token_ids}], params, use_tqdm=False)[0]
            return output.metrics.ttft_s, output.num_cached_tokens or 0

        cold_ttft_s, _ = send(workload.requests[0])
        started = time.perf_counter()
        warm = [send(request) for request in workload.requests[1:]]
        elapsed_s = time.perf_counter() - started
    finally:
        llm.shutdown()
    warm_requests = workload.requests[1:]
    cached = [num_cached for _, num_cached in warm]
    return {
        "cold_ttft_ms": cold_ttft_s * 1000,
        "ttft": LatencyStats.from_seconds(ttft for ttft, _ in warm).as_dict(),
        "cached_tokens_per_request": statistics.mean(cached),
        "prefill_tokens_computed": sum(r.prompt_len for r in warm_requests) - sum(cached),
        "prompt_tokens": sum(r.prompt_len for r in warm_requests),
        "elapsed_s": elapsed_s,
    }


def run(workload: Workload, *, block_size: int = 16, partial_hash_block_size: int | None = None,
        **engine_kwargs: Any) -> dict[str, Any]:
    """TTFT and prefill tokens per configuration; speed-ups relative to caching off."""
    if len(workload.requests) < 2:
        raise ValueError("the prefix benchmark needs at least 2 requests (one fills the cache)")
    partial = partial_hash_block_size or max(1, block_size // 4)
    engine_kwargs = {k: v for k, v in engine_kwargs.items()
                     if k not in ("enable_prefix_caching", "block_size", "hash_block_size")}
    rows = []
    for name, overrides in _configurations(block_size, partial):
        measured = _run_one_engine(workload, {**engine_kwargs, **overrides})
        rows.append({"configuration": name, **overrides, **measured})
    baseline_ms = rows[0]["ttft"]["mean_ms"]
    for row in rows:
        row["ttft_speedup_vs_off"] = baseline_ms / row["ttft"]["mean_ms"]
    return {"workload": workload.summary(), "engine_kwargs": engine_kwargs, "configurations": rows}


def format_result(result: dict[str, Any]) -> str:
    return format_table(
        ["prefix caching", "cold TTFT ms", "TTFT p50 ms", "TTFT p90 ms", "cached tok/req", "prefill tokens",
         "TTFT speed-up"],
        [[r["configuration"], r["cold_ttft_ms"], r["ttft"]["p50_ms"], r["ttft"]["p90_ms"],
          r["cached_tokens_per_request"], r["prefill_tokens_computed"], f"{r['ttft_speedup_vs_off']:.1f}x"]
         for r in result["configurations"]],
        title=f"prefix: {result['workload']['description']}")


def plot_values(result: dict[str, Any]) -> tuple[list[str], list[float]]:
    return ([r["configuration"] for r in result["configurations"]],
            [r["ttft"]["mean_ms"] for r in result["configurations"]])
