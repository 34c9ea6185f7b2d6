"""kvserve against the engines users pick, on the same workloads in the same run.

transformers always runs (same weights dequantized from the GGUF, same dtype,
same token ids, left padding); llama.cpp runs when `llama_cpp` is importable
(on the GGUF file as stored); vLLM's scheduler runs through the scheduler
benchmark when `vllm` is importable. Engines run one after the other, never
at the same time, so they do not compete for the cores.
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any

from kvserve.bench.references import LlamaCppRunner, TransformersRunner, llama_cpp_available
from kvserve.bench.report import format_table
from kvserve.bench.throughput import KvserveRunner, format_results
from kvserve.bench.workloads import Workload

logger = logging.getLogger(__name__)

REFERENCES = ("transformers", "llama.cpp", "vllm-scheduler")


def _run_engine(runner, workloads: list[Workload]) -> list[dict[str, Any]]:
    return [runner.run(workload).as_dict() for workload in workloads]


def run(workloads: list[Workload], model_path: str, *, references=REFERENCES, hf_batch_size: int | None = 32,
        warmup: bool = True, **engine_kwargs: Any) -> dict[str, Any]:
    """Run kvserve and each available reference over `workloads`; ratios are kvserve / reference."""
    kvserve = KvserveRunner(model=model_path, **engine_kwargs)
    try:
        dtype = kvserve.dtype
        if warmup:
            kvserve.warm_up()
        results = _run_engine(kvserve, workloads)
    finally:
        kvserve.shutdown()
    skipped: dict[str, str] = {}
    if "transformers" in references:
        hf = TransformersRunner(model_path, dtype=dtype, batch_size=hf_batch_size)
        if warmup:
            hf.run(Workload("warm-up", workloads[0].requests[:1], "one request"))
        results += _run_engine(hf, workloads)
        del hf
    if "llama.cpp" in references:
        if llama_cpp_available() and model_path.endswith(".gguf"):
            results += _run_engine(LlamaCppRunner(model_path), workloads)
        else:
            skipped["llama.cpp"] = "llama_cpp not importable" if not llama_cpp_available() else "model is not GGUF"
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
        out.append({"workload": r["workload"], "reference": r["engine"],
                    "kvserve_output_tokens_per_s": mine["output_tokens_per_s"],
                    "reference_output_tokens_per_s": r["output_tokens_per_s"],
                    "speedup": mine["output_tokens_per_s"] / r["output_tokens_per_s"]})
    return out


def format_result(result: dict[str, Any]) -> str:
    text = format_results(result["results"], title=f"compare: throughput ({result['dtype']})")
    text += "\n\n" + format_table(
        ["workload", "reference", "kvserve tok/s", "reference tok/s", "kvserve speed-up"],
        [[r["workload"], r["reference"], r["kvserve_output_tokens_per_s"], r["reference_output_tokens_per_s"],
          f"{r['speedup']:.2f}x"] for r in result["ratios"]],
        title="compare: ratios (output tokens/s)")
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
