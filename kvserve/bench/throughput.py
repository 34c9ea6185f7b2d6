"""Offline throughput: a workload through `kvserve.LLM`, timed end to end.

Every request is greedy with `ignore_eos` and its own `max_tokens`, so the
work is fixed; the run checks that each request produced exactly its tokens.
"""
from __future__ import annotations

import time
from typing import Any

from kvserve.bench.references import ThroughputResult
from kvserve.bench.report import format_table
from kvserve.bench.workloads import Workload, fixed_workload


class KvserveRunner:
    """`kvserve.LLM` built from engine keyword arguments (those of `create_engine_config`)."""

    name = "kvserve"

    def __init__(self, **engine_kwargs: Any) -> None:
        from kvserve import LLM

        started = time.perf_counter()
        self.llm = LLM(**engine_kwargs)
        self.load_s = time.perf_counter() - started
        self.engine_kwargs = engine_kwargs

    @property
    def vocab_size(self) -> int:
        return self.llm.model_config.vocab_size

    @property
    def dtype(self) -> str:
        return str(self.llm.model_config.dtype).replace("torch.", "")

    def generate(self, workload: Workload) -> list:
        from kvserve import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                  for r in workload.requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        for request, output in zip(workload.requests, outputs):
            produced = len(output.outputs[0].token_ids)
            if produced != request.output_len:
                raise RuntimeError(f"kvserve produced {produced} tokens for a request that asked for "
                                   f"{request.output_len} (ignore_eos)")
        return outputs

    def warm_up(self) -> None:
        """One small request first, so one-time costs (allocation, lazy init) stay out of the figures."""
        self.generate(fixed_workload(1, 8, 4, vocab_size=self.vocab_size, seed=12345))

    def run(self, workload: Workload) -> ThroughputResult:
        # Rounds repeat the same prompts: without this, every round after the first would be
        # served from the prefix cache while the references compute their prompts again.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("kvserve's prefix cache could not be reset before a timed run")
        started = time.perf_counter()
        outputs = self.generate(workload)
        elapsed_s = time.perf_counter() - started
        return ThroughputResult(self.name, workload.name, len(workload.requests), workload.num_prompt_tokens,
                                workload.num_output_tokens, elapsed_s, self.load_s,
                                notes=f"{self.dtype}, continuous batching",
                                cached_prompt_tokens=sum(output.num_cached_tokens for output in outputs))

    def shutdown(self) -> None:
        self.llm.shutdown()


def run(workloads: list[Workload], *, warmup: bool = True, **engine_kwargs: Any) -> dict[str, Any]:
    """Each workload through one kvserve engine; returns per-workload throughput."""
    runner = KvserveRunner(**engine_kwargs)
    try:
        if warmup:
            runner.warm_up()
        results = [runner.run(workload) for workload in workloads]
    finally:
        runner.shutdown()
    return {
        "engine_kwargs": engine_kwargs,
        "dtype": runner.dtype,
        "load_s": runner.load_s,
        "workloads": [w.summary() for w in workloads],
        "results": [r.as_dict() for r in results],
    }


def format_results(results: list[dict[str, Any]], title: str) -> str:
    headers = ["engine", "workload", "requests", "elapsed s", "req/s", "prompt tok/s", "output tok/s"]
    with_share = all("share_of_batched_ceiling" in r for r in results)
    if with_share:
        headers.append("% of ceiling")
    rows = []
    for r in results:
        row = [r["engine"], r["workload"], r["num_requests"], r["elapsed_s"], r["requests_per_s"],
               r["prompt_tokens_per_s"], r["output_tokens_per_s"]]
        if with_share:
            row.append(f"{r['share_of_batched_ceiling'] * 100:.0f}%")
        rows.append(row + [r["notes"]])
    return format_table(headers + ["notes"], rows, title=title)


def format_result(result: dict[str, Any]) -> str:
    return format_results(result["results"], title=f"throughput (kvserve, {result['dtype']})")
