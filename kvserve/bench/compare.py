"""kvserve against the engines users pick, on the same workloads in the same run.

transformers always runs (same weights dequantized from the GGUF, same dtype,
same token ids, left padding); llama.cpp runs when `llama_cpp` is importable,
batched, by default on the GGUF re-stored at kvserve's dtype (same weights,
same precision; see `gguf_export`), else on the file as stored; vLLM's
scheduler runs through the scheduler benchmark when `vllm` is importable.
Engines run one after the other, never at the same time, so they do not
compete for the cores.

On a shared machine the speed of the cores drifts over minutes. With
`rounds` > 1 every engine stays loaded and each round runs them all, in
alternating order (kvserve first, then last, ...); a workload's figure is the
run with the median time, and each ratio also lists its per-round values
(kvserve against the reference of the same round).
"""
from __future__ import annotations

import importlib.util
import logging
from collections import defaultdict
from typing import Any

from kvserve.bench.references import LlamaCppRunner, TransformersRunner, llama_cpp_available
from kvserve.bench.report import format_table
from kvserve.bench.throughput import KvserveRunner, format_results
from kvserve.bench.workloads import Workload

logger = logging.getLogger(__name__)

REFERENCES = ("transformers", "llama.cpp", "vllm-scheduler")


def _references(references, model_path: str, dtype: str, hf_batch_size: int | None,
                llama_cpp_weights: str) -> tuple[list, dict[str, str]]:
    runners, skipped = [], {}
    if "transformers" in references:
        runners.append(TransformersRunner(model_path, dtype=dtype, batch_size=hf_batch_size))
    if "llama.cpp" in references:
        if llama_cpp_available() and model_path.endswith(".gguf"):
            weights_dtype = dtype if llama_cpp_weights == "dtype" else None
            runners.append(LlamaCppRunner(model_path, dtype=weights_dtype, max_batch=hf_batch_size or 32))
        else:
            skipped["llama.cpp"] = "llama_cpp not importable" if not llama_cpp_available() else "model is not GGUF"
    return runners, skipped


def _warm_up(runner, workloads: list[Workload]) -> None:
    if hasattr(runner, "warm_up"):
        runner.warm_up()
    else:
        runner.run(Workload("warm-up", workloads[0].requests[:1], "one request"))


def _timed_rounds(runners: list, workloads: list[Workload], rounds: int) -> dict[tuple[str, str], list[dict]]:
    """(engine, workload) -> one result per round; engines alternate their order round by round."""
    runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for round_index in range(rounds):
        for runner in (runners if round_index % 2 == 0 else runners[::-1]):
            for workload in workloads:
                runs[runner.name, workload.name].append(runner.run(workload).as_dict())
    return runs


def _median_run(runs: list[dict]) -> dict[str, Any]:
    """The run of median time, with every round's time attached."""
    times = [r["elapsed_s"] for r in runs]
    median = sorted(runs, key=lambda r: r["elapsed_s"])[(len(runs) - 1) // 2]
    return {**median, "rounds_elapsed_s": times}


def run(workloads: list[Workload], model_path: str, *, references=REFERENCES, hf_batch_size: int | None = 32,
        warmup: bool = True, rounds: int = 1, llama_cpp_weights: str = "dtype", **engine_kwargs: Any) -> dict[str, Any]:
    """Run kvserve and each available reference over `workloads`, `rounds` times (see the module
    docstring); ratios are kvserve / reference. `hf_batch_size` is transformers' static batch
    and llama.cpp's number of sequence slots; `llama_cpp_weights` "dtype" runs llama.cpp on the
    GGUF re-stored at kvserve's dtype (equal precision), "stored" on the file as it is."""
    if llama_cpp_weights not in ("dtype", "stored"):
        raise ValueError(f"llama_cpp_weights must be 'dtype' or 'stored', got {llama_cpp_weights!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    kvserve = KvserveRunner(model=model_path, **engine_kwargs)
    try:
        dtype = kvserve.dtype
        reference_runners, skipped = _references(references, model_path, dtype, hf_batch_size, llama_cpp_weights)
        runners = [kvserve, *reference_runners]
        if warmup:
            for runner in runners:
                _warm_up(runner, workloads)
        runs = _timed_rounds(runners, workloads, rounds)
    finally:
        kvserve.shutdown()
    results = [_median_run(r) for r in runs.values()]
    scheduler_comparison = None
    if "vllm-scheduler" in references:
        if importlib.util.find_spec("vllm") is not None:
            from kvserve.bench.scheduler import run as run_scheduler_bench
            scheduler_comparison = run_scheduler_bench()
        else:
            skipped["vllm-scheduler"] = "vllm not importable"
    return {
        "model": model_path,
        "dtype": dtype,
        "engine_kwargs": engine_kwargs,
        "rounds": rounds,
        "workloads": [w.summary() for w in workloads],
        "results": results,
        "ratios": ratios(results),
        "skipped": skipped,
        "scheduler_comparison": scheduler_comparison,
    }


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvserve output tokens/s divided by each reference's, per workload."""
    ours = {r["workload"]: r for r in results if r["engine"] == "kvserve"}
    out = []
    for r in results:
        mine = ours.get(r["workload"])
        if r["engine"] == "kvserve" or mine is None:
            continue
        # Same work on both sides: the tokens/s ratio of a round is the inverse ratio of its times.
        per_round = [theirs / ours_s for ours_s, theirs in zip(mine.get("rounds_elapsed_s", []),
                                                                r.get("rounds_elapsed_s", []))]
        out.append({"workload": r["workload"], "reference": r["engine"],
                    "kvserve_output_tokens_per_s": mine["output_tokens_per_s"],
                    "reference_output_tokens_per_s": r["output_tokens_per_s"],
                    "speedup": mine["output_tokens_per_s"] / r["output_tokens_per_s"],
                    "round_speedups": per_round})
    return out


def format_result(result: dict[str, Any]) -> str:
    text = format_results(result["results"], title=f"compare: throughput ({result['dtype']})")
    text += "\n\n" + format_table(
        ["workload", "reference", "kvserve tok/s", "reference tok/s", "kvserve speed-up", "per round"],
        [[r["workload"], r["reference"], r["kvserve_output_tokens_per_s"], r["reference_output_tokens_per_s"],
          f"{r['speedup']:.2f}x", " ".join(f"{x:.2f}" for x in r.get("round_speedups", []))]
         for r in result["ratios"]],
        title=f"compare: ratios (output tokens/s; median of {result.get('rounds', 1)} round(s))")
    text += _format_scheduler_comparison(result.get("scheduler_comparison"))
    for name, why in result["skipped"].items():
        text += f"\nskipped {name}: {why}"
    return text


def _format_scheduler_comparison(comparison: dict[str, Any] | None) -> str:
    """The vLLM scheduler rows of the same run, or nothing when vLLM was not run."""
    if not comparison or not comparison.get("vllm"):
        return ""
    rows = []
    for num_running, ours in comparison["kvserve"].items():
        theirs = comparison["vllm"].get(num_running, {})
        if "us_per_step" not in theirs:
            rows.append([num_running, f"{ours['us_per_step']:.0f}", theirs.get("error", "-"), "-"])
            continue
        rows.append([num_running, f"{ours['us_per_step']:.0f}", f"{theirs['us_per_step']:.0f}",
                     f"{comparison['ratio_kvserve_over_vllm'][num_running]:.2f}x"])
    return "\n\n" + format_table(["running requests", "kvserve us/step", "vLLM us/step", "kvserve / vLLM"],
                                  rows, title="compare: scheduler step against vLLM")


def plot_values(result: dict[str, Any]) -> tuple[list[str], list[float]]:
    labels = [f"{r['engine']}\n{r['workload']}" for r in result["results"]]
    return labels, [r["output_tokens_per_s"] for r in result["results"]]
