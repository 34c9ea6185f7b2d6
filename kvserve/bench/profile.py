"""Where the time of a decode step goes: matmuls, attention, sampling, Python input preparation.

A batch of requests is prefilled, then decode steps are timed plainly and
then profiled with cProfile. The model step runs on the executor's step
thread, so the profiler is switched on inside that thread by wrapping the
model runner's `execute_model` for the profiled steps only; the engine
thread (scheduling, output handling) gets its own profiler. Time in C
functions (torch ops) is attributed to the kvserve file that called them,
and by op name for the weight matmuls.

cProfile adds a cost to every Python call, so Python shares come out
inflated; the plain step time above them is the undisturbed figure.

Under tensor parallelism (`tensor_parallel_size` > 1) the model runs in worker
processes, out of this process's profilers' reach: only the plain step time is
measured.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import re
import statistics
import time
from collections import defaultdict
from typing import Any

from kvserve.bench.report import format_table
from kvserve.bench.workloads import random_token_ids
from kvserve.engine.create_config import create_engine_config

# Weight matmuls, whichever kernel the model picks (F.linear, addmm, oneDNN's _linear_pointwise, ...).
_MATMUL_OP = re.compile(r"linear|addmm|matmul|bmm|\bmm\b")

NATIVE_DECODER = "native decoder call (all layers, LM head where it runs there)"
CATEGORIES = (
    NATIVE_DECODER,
    "matmul (weights)",
    "attention",
    "sampling",
    "model: other ops (norms, rope, activations, embedding)",
    "worker: input preparation / output",
    "scheduler + KV cache",
    "engine: output processing",
    "torch Python wrappers",
    "other",
)


# The package's own folder: a path substring such as "/kvserve/" would also match the
# checkout's folder, which `git clone` names kvserve too.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kvserve_area(filename: str) -> str | None:
    if filename == "~" or filename.startswith("<"):
        return None
    relative = os.path.relpath(os.path.abspath(filename), _PACKAGE_DIR).replace("\\", "/")
    if relative.startswith("../") or relative == "..":
        return None
    if relative.startswith("model/attention"):
        return "attention"
    if relative.startswith("sample/"):
        return "sampling"
    if relative.startswith("model/"):
        return "model: other ops (norms, rope, activations, embedding)"
    if relative.startswith("worker/"):
        return "worker: input preparation / output"
    if relative.startswith(("scheduler/", "kv_cache/", "request.py")):
        return "scheduler + KV cache"
    if relative.startswith("engine/"):
        return "engine: output processing"
    return "other"


def _category(function: tuple[str, int, str], caller: tuple[str, int, str] | None) -> str:
    filename, _, name = function
    if filename == "~":  # a C function: attribute it by name, then by who called it
        caller_area = _kvserve_area(caller[0]) if caller else None
        is_matmul = _MATMUL_OP.search(name) is not None
        if is_matmul and caller_area != "attention":
            return "matmul (weights)"
        return caller_area or "other"
    # A native kernel's time shows as its ctypes wrapper's own.
    if name == "paged_attention_cpu":
        return "attention"
    if name == "forward" and filename.endswith("model/native_decoder.py"):
        return NATIVE_DECODER
    if name in ("small_linear", "f32_gemm") or (name in ("linear", "panel_linear")
                                                and filename.endswith("model/quantized.py")):
        return "matmul (weights)"
    area = _kvserve_area(filename)
    if area:
        return area
    return "torch Python wrappers" if "/torch/" in filename else "other"


def categorize(stats: pstats.Stats) -> dict[str, float]:
    """Self time (seconds) per category; C functions split across their callers."""
    totals: dict[str, float] = defaultdict(float)
    for function, (_, _, self_s, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if function[0] == "~" and callers:
            for caller, caller_stats in callers.items():
                totals[_category(function, caller)] += caller_stats[2]
        else:
            totals[_category(function, None)] += self_s
    return dict(totals)


def _top_functions(stats: pstats.Stats, limit: int = 12) -> list[dict[str, Any]]:
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:limit]  # type: ignore
    return [{"function": f"{name} ({filename.rsplit('/', 1)[-1]}:{line})" if filename != "~" else name,
             "self_s": values[2], "calls": values[1]} for (filename, line, name), values in rows]


def _prefill(core, num_requests: int, context_len: int, decode_steps: int, vocab_size: int, seed: int) -> None:
    import random

    from kvserve import SamplingParams
    from kvserve.engine.core import EngineCoreRequest

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 64, ignore_eos=True)
    for i in range(num_requests):
        core.add_request(EngineCoreRequest(f"profile-{i}", random_token_ids(rng, context_len, vocab_size), params))
    started_decoding: set[str] = set()
    while len(started_decoding) < num_requests:
        for output in core.step():
            if output.new_token_ids:
                started_decoding.add(output.request_id)
    for _ in range(4):  # a few plain decode steps so every buffer is warm
        core.step()


def run(*, batch_size: int = 32, context_len: int = 256, steps: int = 16, seed: int = 0, ab_fewer_barriers: int = 0,
        ab_moe_split: int = 0, **engine_kwargs: Any) -> dict[str, Any]:
    """Profile `steps` decode steps of `batch_size` requests at about `context_len` tokens of context;
    then, with `ab_fewer_barriers` rounds, A/B the native call's fewer barriers a layer, and with
    `ab_moe_split` rounds its MoE layers' split of the experts over the threads."""
    from kvserve.engine.core import EngineCore

    engine_kwargs.setdefault("max_num_seqs", batch_size)
    config = create_engine_config(**engine_kwargs)
    core = EngineCore(config)
    try:
        runner = getattr(core.executor, "model_runner", None)  # None: tensor-parallel workers run the model
        _prefill(core, batch_size, context_len, (3 + 4 * (ab_fewer_barriers + ab_moe_split)) * steps + 8,
                 config.model_config.vocab_size, seed)
        started = time.perf_counter()
        for _ in range(steps):
            core.step()
        plain_step_s = (time.perf_counter() - started) / steps
        if runner is not None:
            engine_stats, runner_stats, profiled_s = _profiled_steps(core, runner, steps)
            native_split = _native_split(core, runner.model.native_decoder, steps)
            split_ab = _fewer_barriers_ab(core, runner.model.native_decoder, steps, ab_fewer_barriers)
            moe_ab = _moe_split_ab(core, runner.model.native_decoder, steps, ab_moe_split)
            file_mapping = weights_file_mapping(config.model_config.path)
    finally:
        core.shutdown()
    result = {
        "engine_kwargs": engine_kwargs,
        "batch_size": batch_size,
        "context_len": context_len,
        "steps": steps,
        "plain_step_ms": plain_step_s * 1000,
        "plain_decode_tokens_per_s": batch_size / plain_step_s,
    }
    if runner is None:
        return result
    categories = categorize(runner_stats)
    for name, seconds in categorize(engine_stats).items():
        if name not in ("matmul (weights)", "attention", "sampling"):
            categories[name] = categories.get(name, 0.0) + seconds
    total = sum(categories.values())
    return {
        **result,
        "profiled_step_ms": profiled_s / steps * 1000,
        "categories": [{"category": name, "ms_per_step": categories.get(name, 0.0) / steps * 1000,
                        "share": categories.get(name, 0.0) / total if total else 0.0} for name in CATEGORIES],
        "top_functions_model_step": _top_functions(runner_stats),
        "native_split": native_split,
        "fewer_barriers_ab": split_ab,
        "moe_split_ab": moe_ab,
        "weights_file_mapping": file_mapping,
    }


def weights_file_mapping(path: str, smaps: str = "/proc/self/smaps") -> dict[str, float] | None:
    """MiB of the file `path` this process maps now (Rss) and, of those, mapped as 2 MiB folios
    (FilePmdMapped: one TLB entry each, where 4 KiB pages take 512; gguf_file.advise_huge_folios),
    from `smaps`; None where that is unreadable (not Linux) or the file is not mapped."""
    real = os.path.realpath(path)
    totals = {"rss_mib": 0.0, "pmd_mapped_mib": 0.0}
    keys = {"Rss": "rss_mib", "FilePmdMapped": "pmd_mapped_mib"}
    try:
        with open(smaps) as f:
            inside = False
            for line in f:
                fields = line.split()
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    inside = len(fields) >= 6 and line.split(maxsplit=5)[5].strip() == real
                elif inside and fields and fields[0].rstrip(":") in keys:
                    totals[keys[fields[0].rstrip(":")]] += int(fields[1]) / 1024
    except OSError:
        return None
    return totals if totals["rss_mib"] else None


def _fewer_barriers_ab(core, native, steps: int, rounds: int) -> dict[str, Any] | None:
    """ms per step with the native call's fewer barriers a layer ("on": O and down split by
    input columns, K/V written by each thread that reads it) and without ("off"), as `_native_ab`
    (the median ratio off / on: above 1, fewer barriers is faster)."""
    return _native_ab(core, native, steps, rounds, "fewer_barriers", {"on": True, "off": False})


def _moe_split_ab(core, native, steps: int, rounds: int) -> dict[str, Any] | None:
    """ms per step with the MoE layers' chosen experts split over the threads whole ("experts")
    and by each expert's rows ("rows"), as `_native_ab` (the median ratio rows / experts: above 1,
    whole experts are faster); None where the model has no MoE layer in the native call."""
    if native is None or not any(layer.moe for layer in native._layers):
        return None
    return _native_ab(core, native, steps, rounds, "moe_split", {"experts": "experts", "rows": "rows"})


def _native_ab(core, native, steps: int, rounds: int, switch: str, variants: dict[str, Any]) -> dict[str, Any] | None:
    """ms per step with the native decoder's attribute `switch` set to each of two `variants`
    (name -> value), `rounds` rounds of `steps` steps each way, the order alternating by round,
    each followed by as many steps under the phase timer. The figure is the median of the
    per-round ratios second / first."""
    if native is None or rounds <= 0:
        return None
    from kvserve.model.native_decoder import phase_timing

    default = getattr(native, switch)
    first, second = variants
    step_ms: dict[str, list[float]] = {name: [] for name in variants}
    phases: dict[str, list[list[dict[str, float]]]] = {name: [] for name in variants}
    try:
        for r in range(rounds):
            for variant in ((first, second) if r % 2 == 0 else (second, first)):
                setattr(native, switch, variants[variant])
                core.step()
                started = time.perf_counter()
                for _ in range(steps):
                    core.step()
                step_ms[variant].append((time.perf_counter() - started) / steps * 1000)
                with phase_timing(native.num_threads) as timing:
                    for _ in range(steps):
                        core.step()
                calls = max(timing.get("calls", 0), 1)
                phases[variant].append([{k: v / calls * 1000 for k, v in t.items()} for t in timing["threads"]])
    finally:
        setattr(native, switch, default)
    ratios = [b / a for a, b in zip(step_ms[first], step_ms[second])]
    median_phases = {variant: [{k: statistics.median(rnd[t][k] for rnd in rounds_)
                                for k in rounds_[0][t]} for t in range(len(rounds_[0]))]
                     for variant, rounds_ in phases.items()}
    return {"switch": switch, "rounds": rounds, "steps": steps, "step_ms": step_ms,
            f"ratios_{second}_over_{first}": ratios, "median_ratio": statistics.median(ratios),
            "median_phases_ms_per_call": median_phases}


def _native_split(core, native, steps: int) -> dict[str, Any] | None:
    """ms per native call by phase and thread (csrc/decoder/phase_timer.h) over `steps` more steps,
    or None when no step runs the native decoder."""
    if native is None:
        return None
    from kvserve.model.native_decoder import phase_timing

    with phase_timing(native.num_threads) as timing:
        for _ in range(steps):
            core.step()
    calls = timing.get("calls", 0)
    if not calls:
        return None
    return {"calls": calls, "threads": [{phase: seconds / calls * 1000 for phase, seconds in thread.items()}
                                        for thread in timing["threads"]]}


def _profiled_steps(core, runner, steps: int) -> tuple[pstats.Stats, pstats.Stats, float]:
    runner_profiler = cProfile.Profile()
    original = runner.execute_model

    def profiled_execute_model(scheduler_output):
        runner_profiler.enable()
        try:
            return original(scheduler_output)
        finally:
            runner_profiler.disable()

    engine_profiler = cProfile.Profile()
    runner.execute_model = profiled_execute_model  # instance attribute; removed below
    try:
        started = time.perf_counter()
        engine_profiler.enable()
        for _ in range(steps):
            core.step()
        engine_profiler.disable()
        elapsed_s = time.perf_counter() - started
    finally:
        del runner.execute_model
    # The engine thread only waits while the model runs; its wait time is not its own work.
    engine_stats = pstats.Stats(engine_profiler)
    engine_stats.stats = {f: v for f, v in engine_stats.stats.items()  # type: ignore[attr-defined]
                          if not ("acquire" in f[2] or "wait" in f[2])}
    return engine_stats, pstats.Stats(runner_profiler), elapsed_s


def format_result(result: dict[str, Any]) -> str:
    head = (f"profile: decode step, batch {result['batch_size']}, context ~{result['context_len']} tokens: "
            f"{result['plain_step_ms']:.1f} ms/step unprofiled ({result['plain_decode_tokens_per_s']:.0f} tok/s)")
    if "categories" not in result:
        return head + " (tensor parallel: the ranks' processes are not profiled)"
    head += f", {result['profiled_step_ms']:.1f} ms/step under cProfile"
    categories = format_table(["where", "ms/step (profiled)", "share"],
                              [[c["category"], c["ms_per_step"], f"{c['share'] * 100:.1f}%"]
                               for c in result["categories"]], title=head)
    top = format_table(["function (model step)", "self s", "calls"],
                       [[f["function"][:70], f["self_s"], f["calls"]] for f in result["top_functions_model_step"]],
                       title="profile: top functions by self time")
    text = categories + "\n\n" + top
    split = result.get("native_split")
    if split:
        threads = split["threads"]
        rows = [[phase, *(t[phase] for t in threads)] for phase in threads[0]]
        rows.append(["total (the call's wall time)", *(sum(t.values()) for t in threads)])
        text += "\n\n" + format_table(["phase", *(f"thread {i} ms/call" for i in range(len(threads)))], rows,
                                       title=f"profile: inside the native decoder call ({split['calls']} calls)")
    mapping = result.get("weights_file_mapping")
    if mapping:
        text += (f"\n\nweights file: {mapping['rss_mib']:.0f} MiB mapped, {mapping['pmd_mapped_mib']:.0f} MiB of it "
                 f"({100 * mapping['pmd_mapped_mib'] / mapping['rss_mib']:.0f}%) as 2 MiB folios")
    ab = result.get("fewer_barriers_ab")
    if ab:
        text += "\n\n" + _format_ab(ab, "native call with fewer barriers a layer vs more", ("fewer", "more"))
    ab = result.get("moe_split_ab")
    if ab:
        text += "\n\n" + _format_ab(ab, "MoE experts split over the threads whole vs by rows", ("experts", "rows"))
    return text


def _format_ab(ab: dict[str, Any], what: str, labels: tuple[str, str]) -> str:
    first, second = ab["step_ms"]
    a, b = ab["median_phases_ms_per_call"][first], ab["median_phases_ms_per_call"][second]
    rows = [[phase, *(t[phase] for t in a), *(t[phase] for t in b)] for phase in a[0]]
    rows.append(["total", *(sum(t.values()) for t in a), *(sum(t.values()) for t in b)])
    header = ["phase (median of rounds)", *(f"{labels[0]} t{i}" for i in range(len(a))),
              *(f"{labels[1]} t{i}" for i in range(len(b)))]
    title = (f"A/B, {what}, {ab['rounds']} alternating rounds of {ab['steps']} steps: ms/step {labels[0]} "
             f"{', '.join(f'{v:.2f}' for v in ab['step_ms'][first])}; {labels[1]} "
             f"{', '.join(f'{v:.2f}' for v in ab['step_ms'][second])}; median ratio {labels[1]}/{labels[0]} "
             f"{ab['median_ratio']:.3f}")
    return format_table(header, rows, title=title)


def plot_values(result: dict[str, Any]) -> tuple[list[str], list[float]]:
    if "categories" not in result:
        return ["decode step"], [result["plain_step_ms"]]
    return ([c["category"].split(":")[0].split(" (")[0] for c in result["categories"]],
            [c["ms_per_step"] for c in result["categories"]])
