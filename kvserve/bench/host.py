"""Host work per token of a real `LLM.generate` run: wall time per step minus the native call's.

A batch of requests (by default one stream: a 64-token prompt, 128 greedy new tokens,
as `kvserve bench compare --workloads single` runs it) goes through `LLM.generate`
round after round. Each round's wall time is split into the time inside the native
decoder call (`NativeDecoder.call_ns`, measured around the call) and the rest: the
host's work per step (scheduling, input preparation, the call's Python side, sampling,
output handling, thread hand-offs). The pieces are timed by wrapping the engine's and
runner's methods for the round (two clock reads per call, no profiler), less the native
call's time inside them, and reported as medians per call: under load the wall figures
swing with whoever else runs, while these medians stay the host's own work.

`modes` alternate within each round (order reversed every other round) so that each
is compared with the others under the same load: "auto" is the engine's own choice,
"async" always schedules a step ahead, "sync" never does (`EngineCore.schedule_ahead`);
"per-op" is "auto" with the native decoder paused (`DecoderModel.pause_native_decoder`), every
step on the per-op path: `--modes auto,per-op` is the A/B of the native call against it.
"""
from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from typing import Any

from kvserve.bench.report import format_table
from kvserve.bench.workloads import fixed_workload

MODES = {"auto": None, "async": True, "sync": False, "per-op": None}
PER_OP_MODE = "per-op"
# (label, owner, method): each wrapped piece, timed per call without the native call's
# own time where it holds the call (so the medians stay the host's work under load).
PIECES = (
    ("schedule", "scheduler", "schedule"),
    ("runner step", "runner", "execute_model"),
    ("  inputs (InputBatch.prepare)", "input_batch", "prepare"),
    ("  model forward", "model", "forward_logits"),
    ("    native decoder's Python side", "native", "forward"),
    ("  sampling", "runner", "_sample"),
    ("update from output", "scheduler", "update_from_output"),
    ("output processing", "output_processor", "process_outputs"),
)


class _PieceTimer:
    """Wraps methods on their instances and records each call's wall time, less the time
    spent inside the native decoder call meanwhile (`NativeDecoder.call_ns`)."""

    def __init__(self, native) -> None:
        self.native = native
        self.durations_ns: dict[str, list[int]] = defaultdict(list)
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, owner: Any, method: str, label: str) -> None:
        original, native = getattr(owner, method), self.native

        @functools.wraps(original)
        def timed(*args, **kwargs):
            call_ns = native.call_ns
            started = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.durations_ns[label].append(time.perf_counter_ns() - started - (native.call_ns - call_ns))

        setattr(owner, method, timed)
        self._wrapped.append((owner, method))

    def reset(self) -> None:
        self.durations_ns.clear()

    def median_ms(self, label: str) -> float:
        durations = self.durations_ns.get(label)
        return statistics.median(durations) * 1e-6 if durations else 0.0

    def unwrap(self) -> None:
        for owner, method in self._wrapped:
            delattr(owner, method)  # the instance attribute: the class's method shows again
        self._wrapped.clear()


def _owners(llm) -> dict[str, Any]:
    runner = getattr(llm.engine_core.executor, "model_runner", None)
    if runner is None:
        raise RuntimeError("the host benchmark needs the single-process executor (tensor_parallel_size 1)")
    native = runner.model.native_decoder
    if native is None:
        raise RuntimeError("the host benchmark needs a model that runs the native decoder")
    return {"scheduler": llm.engine_core.scheduler, "runner": runner, "input_batch": runner.input_batch,
            "model": runner.model, "native": native, "output_processor": llm.output_processor}


def _one_round(llm, prompts, params, timer: _PieceTimer | None) -> dict[str, Any]:
    native = llm.engine_core.executor.model_runner.model.native_decoder
    calls0, call_ns0 = (native.num_calls, native.call_ns) if native is not None else (0, 0)
    first_step_seq = llm.engine_core.scheduler.sched_step_seq
    if timer is not None:
        timer.reset()
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset before a timed round")
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    native = llm.engine_core.executor.model_runner.model.native_decoder
    num_calls = native.num_calls - calls0 if native is not None else 0
    native_s = (native.call_ns - call_ns0) * 1e-9 if native is not None else 0.0
    steps = max(llm.engine_core.scheduler.sched_step_seq - first_step_seq, 1)  # steps that ran tokens
    result = {"wall_s": wall_s, "tokens": num_tokens, "tokens_per_s": num_tokens / wall_s, "steps": steps,
              "native_calls": num_calls, "native_ms_per_call": native_s / max(num_calls, 1) * 1e3,
              "host_ms_per_step": (wall_s - native_s) / steps * 1e3}
    if timer is not None:
        result["pieces_ms_per_call"] = {label: timer.median_ms(label) for label, *_ in PIECES}
    return result


def run(*, batch_size: int = 1, prompt_len: int = 64, output_len: int = 128, rounds: int = 5,
        modes: tuple[str, ...] = ("auto",), split: bool = True, seed: int = 0,
        **engine_kwargs: Any) -> dict[str, Any]:
    """`rounds` rounds of `batch_size` requests (`prompt_len` -> `output_len` greedy tokens)
    through one `LLM`, each round running every mode in turn."""
    from kvserve import LLM, SamplingParams

    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be among {sorted(MODES)}, got {list(modes)}")
    if any(MODES[m] for m in modes) and engine_kwargs.get("async_scheduling") is False:
        raise ValueError("mode 'async' needs async scheduling (drop --no-async-scheduling)")
    engine_kwargs.setdefault("max_num_seqs", batch_size)
    llm = LLM(**engine_kwargs)
    try:
        workload = fixed_workload(batch_size, prompt_len, output_len, vocab_size=llm.model_config.vocab_size,
                                  seed=seed)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: kernels, buffers, the native decoder
        timer = None
        if split:
            owners = _owners(llm)
            timer = _PieceTimer(owners["native"])
            for label, owner, method in PIECES:
                timer.wrap(owners[owner], method, label)
        by_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        model = llm.engine_core.executor.model_runner.model
        try:
            for r in range(rounds):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    llm.engine_core.schedule_ahead = MODES[mode]
                    model.pause_native_decoder(mode == PER_OP_MODE)
                    by_mode[mode].append(_one_round(llm, prompts, params, timer))
        finally:
            llm.engine_core.schedule_ahead = None
            model.pause_native_decoder(False)
            if timer is not None:
                timer.unwrap()
    finally:
        llm.shutdown()
    return {"engine_kwargs": engine_kwargs, "batch_size": batch_size, "prompt_len": prompt_len,
            "output_len": output_len, "rounds": rounds, "modes": list(modes),
            "summary": {m: _summary(by_mode[m], by_mode[modes[0]]) for m in modes}, "rounds_by_mode": by_mode}


def _summary(mode_rounds: list[dict[str, Any]], first_rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds; `speed_vs_first` is the median of the per-round ratios of
    tokens/s to the first mode's."""
    def median(key: str) -> float:
        return statistics.median(r[key] for r in mode_rounds)

    summary = {key: median(key) for key in ("tokens_per_s", "native_ms_per_call", "host_ms_per_step")}
    summary["speed_vs_first"] = statistics.median(
        a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mode_rounds, first_rounds))
    if "pieces_ms_per_call" in mode_rounds[0]:
        summary["pieces_ms_per_call"] = {
            label: statistics.median(r["pieces_ms_per_call"][label] for r in mode_rounds)
            for label in mode_rounds[0]["pieces_ms_per_call"]}
    return summary


def format_result(result: dict[str, Any]) -> str:
    modes = result["modes"]
    summaries = [result["summary"][m] for m in modes]
    rows = [["tokens/s (median of rounds)", *(s["tokens_per_s"] for s in summaries)],
            [f"speed vs {modes[0]} (median of per-round ratios)", *(s["speed_vs_first"] for s in summaries)],
            ["native call, ms per call", *(s["native_ms_per_call"] for s in summaries)],
            ["host work, ms per step (wall - native)", *(s["host_ms_per_step"] for s in summaries)]]
    if "pieces_ms_per_call" in summaries[0]:
        for label in summaries[0]["pieces_ms_per_call"]:
            rows.append([f"  {label}, median ms per call", *(s["pieces_ms_per_call"][label] for s in summaries)])
    title = (f"host: batch {result['batch_size']}, {result['prompt_len']} -> {result['output_len']} tokens, "
             f"{result['rounds']} rounds through LLM.generate (medians over rounds; the pieces without "
             f"the native call's time)")
    return format_table(["", *modes], rows, title=title)


def plot_values(result: dict[str, Any]) -> tuple[list[str], list[float]]:
    return list(result["modes"]), [result["summary"][m]["host_ms_per_step"] for m in result["modes"]]
