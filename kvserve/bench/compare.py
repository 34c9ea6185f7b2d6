"""kvserve against the engines users pick, on the same workloads in the same run.

Every engine runs in its own child process (`engine_process`): measured in
one process, engines slow each other down. Each child uses the parent's torch
thread count (llama.cpp included), loads once, warms up, and then runs every
workload once per round; rounds alternate the order of the engines (kvserve
first, then last, ...), and only one engine computes at a time.

References: transformers on the same weights (dequantized from the GGUF, same
dtype, same token ids) twice, as a user would pick its best offline path:
length-sorted static batches ("transformers") and its own continuous batching
("transformers-cb"), both at kvserve's concurrency; llama.cpp (when
`llama_cpp` is importable) batched through its low-level API, on the file as
stored or re-stored at kvserve's dtype, with its default (repacked) buffers
unless they crash; vLLM's scheduler through the scheduler benchmark when
`vllm` is importable.

A workload's figure per engine is its run of median time; a ratio is the
median of the per-round ratios (kvserve against the reference of the same
round), the quantity that survives a machine whose speed drifts over minutes.

A reference that fails (its child crashes, e.g. llama.cpp's AMX kernels on
some CPUs, or raises) is never skipped or handicapped silently: each failure
goes to the result's `reference_failures` (engine, phase, round, workload,
signal or exit code, the first line of the error, and what was done: retried
on plain buffers, or left out of the later rounds) and is printed; its
figures cover only the rounds it completed.
"""
from __future__ import annotations

import importlib.util
import logging
import statistics
from collections import defaultdict
from typing import Any

from kvserve.bench.engine_process import (EngineProcess, EngineProcessError, RunnerSpec, failure_record,
                                          format_failures, generate_peak_rss)
from kvserve.bench.references import llama_cpp_available
from kvserve.bench.report import format_table
from kvserve.bench.throughput import format_results
from kvserve.bench.workloads import Workload

logger = logging.getLogger(__name__)

REFERENCES = ("transformers", "transformers-cb", "llama.cpp", "vllm-scheduler")
# Reference engines whose best per round stands for the library ("transformers at its best").
_BEST_OF = {"transformers (best)": ("transformers", "transformers-cb")}


def _torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def _reference_specs(references, model_path: str, dtype: str, concurrency: int,
                     llama_cpp_weights: str) -> tuple[list[RunnerSpec], dict[str, str]]:
    specs, skipped = [], {}
    for name, strategy in (("transformers", "static"), ("transformers-cb", "continuous")):
        if name in references:
            specs.append(RunnerSpec(name, "kvserve.bench.references:TransformersRunner",
                                    {"model_path": model_path, "dtype": dtype, "batch_size": concurrency,
                                     "strategy": strategy}))
    if "llama.cpp" in references:
        if llama_cpp_available() and model_path.endswith(".gguf"):
            weights_dtype = dtype if llama_cpp_weights == "dtype" else None
            specs.append(RunnerSpec("llama.cpp", "kvserve.bench.references:LlamaCppRunner",
                                    {"model_path": model_path, "dtype": weights_dtype, "max_batch": concurrency}))
        else:
            skipped["llama.cpp"] = "llama_cpp not importable" if not llama_cpp_available() else "model is not GGUF"
    return specs, skipped


def _start(spec: RunnerSpec, num_threads: int, workloads: list[Workload], warmup: bool,
           failures: list[dict[str, Any]] | None = None) -> EngineProcess:
    """The engine loaded (and warmed up) in its own process. llama.cpp's repacked buffers crash on
    some CPUs: then it starts again on its plain CPU buffers, and `failures` records it."""
    phase = "loading"
    try:
        engine = EngineProcess(spec, num_threads)
        phase = "warm-up"
        if warmup:
            engine.warm_up(Workload("warm-up", workloads[0].requests[:1], "one request"))
        return engine
    except EngineProcessError as error:
        if spec.name != "llama.cpp" or spec.kwargs.get("extra_buffers") is False:
            raise
        action = "retried on plain CPU buffers (extra_buffers=False)"
        logger.warning("llama.cpp with its default (repacked) buffers failed: %s; %s",
                       str(error).splitlines()[0], action)
        if failures is not None:
            failures.append(failure_record(spec.name, error, phase, action))
        return _start(RunnerSpec(spec.name, spec.factory, {**spec.kwargs, "extra_buffers": False}),
                      num_threads, workloads, warmup, failures)


def _timed_rounds(engines: list[EngineProcess], workloads: list[Workload], rounds: int,
                  failures: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict]]:
    """(engine, workload) -> one result per round; engines alternate their order round by round.
    A reference that fails is recorded in `failures` and runs no more (kvserve's failure raises)."""
    runs: dict[tuple[str, str], list[dict]] = defaultdict(list)
    running = list(engines)
    for round_index in range(rounds):
        for engine in (list(running) if round_index % 2 == 0 else running[::-1]):
            for workload in workloads:
                try:
                    result = engine.run(workload)
                except EngineProcessError as error:
                    if engine is engines[0]:
                        raise
                    logger.error("%s failed in round %d: %s; it runs no more rounds", engine.name,
                                 round_index + 1, str(error).splitlines()[0])
                    failures.append(failure_record(engine.name, error, "run", "left out of the later rounds",
                                                   round_index + 1, workload.name))
                    running.remove(engine)
                    break
                runs[engine.name, workload.name].append(result)
    return runs


def _median_run(runs: list[dict]) -> dict[str, Any]:
    """The run of median time, with every round's time attached."""
    times = [r["elapsed_s"] for r in runs]
    median = sorted(runs, key=lambda r: r["elapsed_s"])[(len(runs) - 1) // 2]
    return {**median, "rounds_elapsed_s": times}


def _facts(engine: EngineProcess, num_threads: int) -> dict[str, Any]:
    return {"load_s": engine.load_s, "dtype": engine.dtype, "num_threads": num_threads,
            "runner_kwargs": engine.spec.kwargs, "peak_rss_mib": engine.info.get("peak_rss_mib")}


def _run_engines(first: EngineProcess, specs: list[RunnerSpec], workloads: list[Workload], rounds: int,
                 warmup: bool, num_threads: int) -> tuple[list[dict], dict[str, dict], list[dict]]:
    """With `first` (kvserve) started, start every other engine in its own process, run the rounds,
    stop them all; returns (median runs, facts per engine: load time, threads, peak RSS, and the
    references' failures). A reference that cannot start is recorded and left out."""
    engines: list[EngineProcess] = [first]
    failures: list[dict[str, Any]] = []
    try:
        for spec in specs:
            try:
                engines.append(_start(spec, num_threads, workloads, warmup, failures))
            except EngineProcessError as error:
                logger.error("%s could not start: %s; it is left out", spec.name, str(error).splitlines()[0])
                failures.append(failure_record(spec.name, error, "start", "left out of every round"))
        runs = _timed_rounds(engines, workloads, rounds, failures)
    finally:
        facts = {engine.name: _facts(engine, num_threads) for engine in engines}
        for engine in engines:
            facts[engine.name].update(engine.close())
    return [_median_run(r) for r in runs.values()], facts, failures


def run(workloads: list[Workload], model_path: str, *, references=REFERENCES, hf_batch_size: int | None = 32,
        warmup: bool = True, rounds: int = 1, llama_cpp_weights: str = "stored",
        num_threads: int | None = None, generate_rss: bool = True, **engine_kwargs: Any) -> dict[str, Any]:
    """Run kvserve and each available reference over `workloads`, `rounds` times (see the module
    docstring); ratios are kvserve / reference. `hf_batch_size` is the references' concurrency
    (transformers' batch, llama.cpp's sequence slots); `llama_cpp_weights` "stored" runs llama.cpp
    on the file as it is, "dtype" on the GGUF re-stored at kvserve's dtype (equal precision).
    `generate_rss` first measures the peak RSS of `kvserve generate` on the model with its defaults."""
    if llama_cpp_weights not in ("dtype", "stored"):
        raise ValueError(f"llama_cpp_weights must be 'dtype' or 'stored', got {llama_cpp_weights!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    num_threads = num_threads or _torch_threads()
    generate_memory = generate_peak_rss(model_path) if generate_rss else None
    kvserve_spec = RunnerSpec("kvserve", "kvserve.bench.throughput:KvserveRunner",
                              {"model": model_path, **engine_kwargs})
    # kvserve starts first: its dtype (the engine's resolved default) sets the references'.
    kvserve_engine = _start(kvserve_spec, num_threads, workloads, warmup)
    dtype = kvserve_engine.dtype
    try:
        reference_specs, skipped = _reference_specs(references, model_path, dtype, hf_batch_size or 32,
                                                    llama_cpp_weights)
    except BaseException:
        kvserve_engine.close()
        raise
    results, engines, failures = _run_engines(kvserve_engine, reference_specs, workloads, rounds, warmup,
                                              num_threads)
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
        "num_threads": num_threads,
        "workloads": [w.summary() for w in workloads],
        "engines": engines,
        "kvserve_generate_peak_rss": generate_memory,
        "results": results,
        "ratios": ratios(results),
        "skipped": skipped,
        "reference_failures": failures,
        "scheduler_comparison": scheduler_comparison,
    }


def _best_of_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, a synthetic reference whose time in each round is the fastest of its members."""
    by_key = {(r["engine"], r["workload"]): r for r in results}
    rows = []
    for best_name, members in _BEST_OF.items():
        for workload in dict.fromkeys(r["workload"] for r in results):
            runs = [by_key[m, workload] for m in members if (m, workload) in by_key]
            if len(runs) < 2:
                continue
            times = [min(ts) for ts in zip(*(r["rounds_elapsed_s"] for r in runs))]
            median_s = sorted(times)[(len(times) - 1) // 2]
            rows.append({**runs[0], "engine": best_name, "elapsed_s": median_s, "rounds_elapsed_s": times,
                         "output_tokens_per_s": runs[0]["output_tokens"] / median_s,
                         "notes": "per round, the faster of " + ", ".join(members)})
    return rows


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kvserve against each reference, per workload: the median of the per-round ratios of output
    tokens/s (`speedup`), each round's ratio, and the ratio of the median runs."""
    ours = {r["workload"]: r for r in results if r["engine"] == "kvserve"}
    out = []
    for r in [*results, *_best_of_rows(results)]:
        mine = ours.get(r["workload"])
        if r["engine"] == "kvserve" or mine is None:
            continue
        # Same work on both sides: the tokens/s ratio of a round is the inverse ratio of its times.
        per_round = [theirs / ours_s for ours_s, theirs in zip(mine.get("rounds_elapsed_s", []),
                                                                r.get("rounds_elapsed_s", []))]
        of_medians = mine["output_tokens_per_s"] / r["output_tokens_per_s"]
        out.append({"workload": r["workload"], "reference": r["engine"],
                    "kvserve_output_tokens_per_s": mine["output_tokens_per_s"],
                    "reference_output_tokens_per_s": r["output_tokens_per_s"],
                    "kvserve_elapsed_s": mine["elapsed_s"], "reference_elapsed_s": r["elapsed_s"],
                    "speedup": statistics.median(per_round) if per_round else of_medians,
                    "ratio_of_medians": of_medians, "round_speedups": per_round})
    return out


def format_result(result: dict[str, Any]) -> str:
    text = format_results(result["results"], title=f"compare: each engine alone in its own process "
                                                   f"({result['dtype']}, {result.get('num_threads')} threads)")
    text += _format_engines(result.get("engines") or {})
    text += "\n\n" + format_table(
        ["workload", "reference", "kvserve tok/s", "reference tok/s", "kvserve speed-up", "per round"],
        [[r["workload"], r["reference"], r["kvserve_output_tokens_per_s"], r["reference_output_tokens_per_s"],
          f"{r['speedup']:.2f}x", " ".join(f"{x:.2f}" for x in r.get("round_speedups", []))]
         for r in result["ratios"]],
        title=f"compare: ratios (kvserve / reference output tokens/s, median of "
              f"{result.get('rounds', 1)} per-round ratio(s))")
    memory = result.get("kvserve_generate_peak_rss")
    if memory:
        text += f"\n\npeak RSS of `{memory['command']}`: {memory['peak_rss_mib']:.0f} MiB"
    text += _format_scheduler_comparison(result.get("scheduler_comparison"))
    for name, why in result["skipped"].items():
        text += f"\nskipped {name}: {why}"
    text += format_failures(result.get("reference_failures") or [])
    return text


def _format_engines(engines: dict[str, dict]) -> str:
    if not engines:
        return ""
    return "\n\n" + format_table(
        ["engine", "load s", "threads", "peak RSS MiB", "runner"],
        [[name, facts.get("load_s"), facts.get("num_threads"), facts.get("peak_rss_mib"),
          ", ".join(f"{k}={v}" for k, v in facts.get("runner_kwargs", {}).items() if k not in ("model", "model_path"))]
         for name, facts in engines.items()], title="compare: engines (one child process each)")


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
