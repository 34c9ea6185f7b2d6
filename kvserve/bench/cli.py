"""`kvserve bench ...`: argument parsing and output (table, JSON, PNG) for every benchmark.

Each sub-command builds its inputs from flags, calls the benchmark's `run`,
prints a table, writes JSON (`--output-json`, default `bench_results/<name>.json`)
and, where a picture helps, a PNG next to it (`--no-plot` skips it).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable

from kvserve.bench.cli_args import COMMANDS, add_output_arguments, int_list, name_list
from kvserve.bench.cli_output import FORMATTERS
from kvserve.bench.report import bar_plot, default_output_path, environment_info, run_tag, write_json

SUBCOMMANDS = ("roofline", "throughput", "serve", "serve-compare", "prefix", "compare", "profile", "host", "scheduler",
               "kv", "attention", "gguf", "structured", "route", "spec", "plan-check", "allreduce", "startup", "zoo")


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` and its sub-commands to the `kvserve` sub-parsers; returns the `bench` parser."""
    bench = subparsers.add_parser("bench", help="benchmarks: roofline, throughput, serve, prefix, compare, ...",
                                  description="Measure kvserve: each sub-command prints a table and writes "
                                              "JSON (and a PNG) under bench_results/.")
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK",
                                    parser_class=type(bench))
    commands.required = True
    for name, (add_arguments, help_text) in COMMANDS.items():
        parser = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(parser)
        add_output_arguments(parser)
    return bench


def run(args: argparse.Namespace) -> int:
    """Run the benchmark `args.bench_command`; returns the exit code."""
    name = args.bench_command
    if name == "zoo":
        return _run_zoo(args)
    _resolve_zoo_model(args)
    environment = environment_info()
    result = _RUNNERS[name](args)
    if name in BOUNDED_COMMANDS:
        _with_bandwidth_bound(result, args)
    environment["load_average_1m_end"] = _load_average()
    # torch is imported by the benchmark itself; its version and threads are known only now.
    environment.update({k: v for k, v in environment_info().items() if k.startswith(("torch", "cuda"))})
    payload = {"benchmark": name, "environment": environment, "result": result}
    formatter, plotter = FORMATTERS[name]
    print(formatter(result))
    bound = result.get("bandwidth_bound") or result.get("model_file")
    if bound and "skipped" not in bound:
        print(f"\nbandwidth bound: {bound['single_sequence_tokens_per_s']:.1f} tok/s per sequence "
              f"({bound['weight_bytes_per_token'] / 1e6:.1f} MB of weights read per token from {bound['model']}, "
              f"{bound['read_bandwidth_gb_per_s']:.1f} GB/s read); each rate's share of it is in the JSON "
              f"(*_pct_of_bound)")
    busiest = max(environment.get("load_average_1m", 0.0), environment["load_average_1m_end"])
    if busiest > (environment.get("cpu_count") or 1):
        print(f"\nnote: load average {busiest:.1f} on {environment.get('cpu_count')} CPUs while measuring: "
              f"other work competed for the cores, so these figures are low")
    # Comparisons are the figures BENCHMARKS.md cites: each run keeps its own file.
    tag = "-".join([*name_list(getattr(args, "workloads", "")), run_tag()]) if name in _NAMED_RUNS else None
    json_path = write_json(args.output_json or default_output_path(name, ".json", tag), payload)
    print(f"\nJSON: {json_path}")
    if plotter is not None and not args.no_plot:
        png_path = Path(args.output_png) if args.output_png else json_path.with_suffix(".png")
        labels, values, title, ylabel = plotter(result)
        lines = None
        if "ceilings" in result:
            lines = {"batched ceiling": result["ceilings"]["batched_tokens_per_s"],
                     "single-stream ceiling": result["ceilings"]["single_stream_tokens_per_s"]}
        print(f"plot: {bar_plot(png_path, labels, values, title=title, ylabel=ylabel, reference_lines=lines)}")
    return 0


# Commands whose results hold output-token rates (single stream, batched, serving): each
# rate gets its memory-bandwidth bound and the share of it reached (bench/bandwidth_bound.py).
BOUNDED_COMMANDS = ("throughput", "compare", "serve", "serve-compare", "host", "profile", "spec")


def _with_bandwidth_bound(result: dict[str, Any], args: argparse.Namespace) -> None:
    from kvserve.bench import bandwidth_bound
    from kvserve.bench.model_info import resolve_model_path

    model = getattr(args, "model", None)
    # Engine commands run the default model without --model; a served model is named only by --model.
    path = resolve_model_path(model) if model or args.bench_command != "serve" else None
    bandwidth_bound.attach(result, path, getattr(args, "roofline_json", None))


def _resolve_zoo_model(args: argparse.Namespace) -> None:
    """Replace a `--model zoo:NAME` by the zoo file's path, building it first when not cached."""
    from kvserve.bench import zoo
    if zoo.is_zoo_name(getattr(args, "model", None)):
        print(f"zoo model {args.model}: ", end="", flush=True)
        args.model = zoo.resolve_zoo_model(args.model)
        print(args.model, flush=True)


def _run_zoo(args: argparse.Namespace) -> int:
    from kvserve.bench import zoo
    result = zoo.build_many(args.names, all_standard=args.all)
    if "models" in result:
        for row in result["models"]:
            print(f"{row['shape']:<12} {row['like']:<48} {row['parameters'] / 1e9:6.2f}B  "
                  f"cached: {', '.join(row['cached']) or '-'}")
        print(f"\ntypes: {', '.join(zoo.QUANT_TYPES)}; cache: {zoo.zoo_dir()}")
    for name, built in result.get("built", {}).items():
        print(f"zoo:{name}  {built['path']}  {built['bytes'] / 2**20:.0f} MiB")
    return 0


def _load_average() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.engine.arg_utils import engine_kwargs_from_args
    return engine_kwargs_from_args(args)


def _run_roofline(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import roofline
    from kvserve.bench.model_info import ModelShapes, model_shapes, resolve_model_path

    if args.tiny:
        shapes = ModelShapes(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=16, vocab_size=256)
    else:
        shapes = model_shapes(resolve_model_path(args.model))
    result = roofline.run(shapes, dtypes=name_list(args.dtypes), batch_sizes=int_list(args.batch_sizes),
                          bandwidth_bytes=args.bandwidth_mib << 20, repeats=args.repeats, device=args.device,
                          num_threads=args.threads, kernels=name_list(args.kernels))
    if not args.tiny:
        from kvserve.bench import bandwidth_bound
        result["model_file"] = bandwidth_bound.bound(resolve_model_path(args.model), result["read_bandwidth_gb_per_s"],
                                                     "measured by this run")
    return result


def _run_serve(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import serve

    return serve.run(_serve_config(args))


def _serve_config(args: argparse.Namespace):
    from kvserve.bench import serve

    concurrency = args.concurrency if args.concurrency or args.request_rate else 8
    return serve.ServeBenchConfig(
        base_url=args.base_url, model=args.served_model, endpoint=args.endpoint, num_prompts=args.num_prompts,
        prompt_words=args.prompt_words, max_tokens=args.max_tokens, concurrency=concurrency,
        request_rate=args.request_rate, ignore_eos=not args.no_ignore_eos, api_key=args.api_key, seed=args.seed,
        timeout_s=args.timeout, trace_out=args.trace_out)


def _run_serve_compare(args: argparse.Namespace) -> dict[str, Any]:
    import shlex

    from kvserve.bench import serve_compare
    from kvserve.bench.model_info import resolve_model_path

    return serve_compare.run(resolve_model_path(args.model), _serve_config(args), rounds=args.rounds,
                             kvserve_args=shlex.split(args.kvserve_args), llama_server=args.llama_server,
                             context_per_slot=args.context_per_slot)


def _workloads(args: argparse.Namespace, vocab_size: int) -> list:
    from kvserve.bench.workloads import build_workload

    return [build_workload(name, vocab_size=vocab_size, num_requests=args.num_prompts, prompt_len=args.prompt_len,
                           output_len=args.output_len, seed=args.workload_seed,
                           max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len,
                           prefill_len=args.prefill_len)
            for name in name_list(args.workloads)]


def _vocab_size(model: str | None) -> int:
    from kvserve.bench.model_info import model_shapes, resolve_model_path
    return model_shapes(resolve_model_path(model)).vocab_size


def _run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import throughput

    kwargs = _engine_kwargs(args)
    result = throughput.run(_workloads(args, _vocab_size(args.model)), warmup=not args.no_warmup, **kwargs)
    return _with_ceilings(result, args.roofline_json)


def _run_compare(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import compare
    from kvserve.bench.model_info import resolve_model_path

    kwargs = _engine_kwargs(args)
    model_path = resolve_model_path(kwargs.pop("model", None))
    result = compare.run(_workloads(args, _vocab_size(model_path)), model_path,
                         references=name_list(args.references), hf_batch_size=args.hf_batch_size,
                         warmup=not args.no_warmup, rounds=args.rounds,
                         llama_cpp_weights=args.llama_cpp_weights, generate_rss=not args.no_generate_rss,
                         **kwargs)
    return _with_ceilings(result, args.roofline_json)


def _with_ceilings(result: dict[str, Any], roofline_json: str | None) -> dict[str, Any]:
    """Attach the roofline ceilings of the run's dtype and each run's share of the batched one."""
    if not roofline_json:
        return result
    roofline_result = json.loads(Path(roofline_json).read_text(encoding="utf-8"))["result"]
    ceilings = roofline_result["by_dtype"].get(result["dtype"])
    if ceilings is None:
        raise ValueError(f"{roofline_json} has no {result['dtype']} figures")
    result["ceilings"] = {"dtype": result["dtype"],
                          "batched_tokens_per_s": ceilings["batched_ceiling_tokens_per_s"],
                          "single_stream_tokens_per_s": ceilings["single_stream_ceiling_tokens_per_s"]}
    for run in result["results"]:
        # Prompt and output tokens both pass through every weight matmul.
        all_tokens_per_s = (run["prompt_tokens"] + run["output_tokens"]) / run["elapsed_s"]
        run["share_of_batched_ceiling"] = all_tokens_per_s / ceilings["batched_ceiling_tokens_per_s"]
    return result


def _run_prefix(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import prefix
    from kvserve.bench.workloads import shared_prefix_workload

    kwargs = _engine_kwargs(args)
    workload = shared_prefix_workload(args.num_requests, args.prefix_len, args.question_len, args.output_len,
                                      vocab_size=_vocab_size(args.model), seed=args.workload_seed)
    kwargs.pop("enable_prefix_caching", None)
    return prefix.run(workload, block_size=kwargs.pop("block_size", 16),
                      partial_hash_block_size=args.partial_hash_block_size, **kwargs)


def _run_profile(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import profile

    return profile.run(batch_size=args.batch_size, context_len=args.context_len, steps=args.steps,
                       ab_fewer_barriers=args.ab_fewer_barriers, ab_moe_split=args.ab_moe_split,
                       **_engine_kwargs(args))


def _run_host(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import host

    return host.run(batch_size=args.batch_size, prompt_len=args.prompt_len, output_len=args.output_len,
                    rounds=args.rounds, modes=tuple(name_list(args.modes)), split=not args.no_split,
                    **_engine_kwargs(args))


def _call_with_supported(fn: Callable[..., dict], **kwargs: Any) -> dict[str, Any]:
    """Call another area's `run()` with the keyword arguments it accepts."""
    accepted = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return fn(**kwargs)


def _run_scheduler(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import scheduler

    return _call_with_supported(scheduler.run, num_running=tuple(int_list(args.num_running)),
                                prompt_len=args.prompt_len, output_len=args.output_len, block_size=args.block_size)


def _run_kv(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import kv

    return _call_with_supported(kv.run, num_requests=args.num_requests)


def _run_attention(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import attention

    return attention.run(batch_sizes=tuple(int_list(args.batch_sizes)), context_lens=tuple(int_list(args.context_lens)),
                         kv_dtypes=tuple(name_list(args.kv_dtypes)),
                         isas=tuple(name_list(args.isas)) if args.isas else None, num_heads=args.num_heads,
                         num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                         layers=args.layers, repeats=args.repeats, threads=args.threads)


def _run_gguf(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import gguf_kernels

    return gguf_kernels.run(types=tuple(name.upper() for name in name_list(args.types)), out_features=args.out_features,
                            in_features=args.in_features, batch_sizes=tuple(int_list(args.batch_sizes)),
                            threads=tuple(int_list(args.threads)),
                            isas=tuple(name_list(args.isas)) if args.isas else None,
                            footprint_mb=args.footprint_mb, repeats=args.repeats)


def _run_structured(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import structured

    engine_kwargs = _engine_kwargs(args)
    return structured.run(engine_kwargs.pop("model", None), batch=args.batch, rounds=args.rounds,
                          max_tokens=args.max_tokens, skip_engine=args.skip_engine, **engine_kwargs)


def _run_spec(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import spec

    scenarios = tuple(name.strip() for name in args.scenarios.split(",") if name.strip())
    unknown = sorted(set(scenarios) - set(spec.SCENARIOS))
    if unknown:
        raise SystemExit(f"kvserve: error: unknown scenario(s) {unknown}; known: {list(spec.SCENARIOS)}")
    return spec.run(rounds=args.rounds, max_tokens=args.max_tokens, scenarios=scenarios,
                    draft_layers=args.draft_layers, control=args.control, **_engine_kwargs(args))


def _run_route(args: argparse.Namespace) -> dict[str, Any]:
    import shlex

    from kvserve.bench import route
    json_path = Path(args.output_json or default_output_path("route", ".json"))
    config = route.RouteBenchConfig(
        num_replicas=args.replicas, policies=tuple(name_list(args.policies)), num_users=args.num_users,
        num_system_prompts=args.num_system_prompts, system_prompt_words=args.system_prompt_words,
        turns=args.turns, max_tokens=args.max_tokens, concurrency=args.concurrency, seed=args.seed,
        replica_flags=tuple(shlex.split(args.replica_args)), replica_threads=args.replica_threads or None,
        kill_replica_after=args.kill_replica_after,
        trace_out=args.trace_out or str(json_path.with_suffix(".trace.jsonl")))
    result = route.run(config)
    if not args.no_plot:
        png_path = Path(args.output_png) if args.output_png else json_path.with_suffix(".png")
        png_path.parent.mkdir(parents=True, exist_ok=True)
        result["plot"] = route.plot(result, png_path)
    return result


def _run_plan_check(args: argparse.Namespace) -> dict[str, Any]:
    import shlex

    from kvserve.bench import plan_check
    from kvserve.planner.plan import Load, SchedulerShape
    from kvserve.planner.cli import check_bounds
    check_bounds(args, plan_check.FLAG_BOUNDS, "kvserve bench plan-check")
    load = Load(args.arrival_rate, args.prompt_len, args.len_sigma, args.output_len, args.len_sigma,
                args.shared_prefix_ratio, args.num_shared_prefixes, args.max_model_len)
    json_path = args.output_json or default_output_path("plan-check", ".json")
    config = plan_check.PlanCheckConfig(
        model=args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
        shape=SchedulerShape(args.block_size, args.max_num_seqs, args.max_num_batched_tokens), load=load,
        num_requests=args.num_requests, trace_path=args.trace,
        trace_out=args.trace_out or plan_check.trace_path_next_to(json_path), seed=args.seed,
        threads=args.server_threads or None, extra_flags=tuple(shlex.split(args.server_args)),
        roofline_json=args.roofline_json, roofline_dtype=args.roofline_dtype, tp=args.tp,
        activation_bytes=args.activation_bytes)
    return plan_check.run(config)


def _run_allreduce(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.planner.interconnect import measure_interconnect

    return {"interconnect": measure_interconnect(args.world_size, repeats=args.repeats).as_json()}


# ---------------------------------------------------------------- dispatch


_NAMED_RUNS = ("compare", "serve-compare", "startup")

def _run_startup(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.bench import startup
    return startup.run(os.path.abspath(args.model), rounds=args.rounds, max_tokens=args.max_tokens,
                       prompt=args.prompt, cold=args.cold, n_ctx=args.n_ctx)


_RUNNERS = {
    "roofline": _run_roofline, "throughput": _run_throughput, "serve": _run_serve,
    "serve-compare": _run_serve_compare, "prefix": _run_prefix,
    "compare": _run_compare, "profile": _run_profile, "host": _run_host, "scheduler": _run_scheduler, "kv": _run_kv,
    "attention": _run_attention,
    "gguf": _run_gguf,
    "structured": _run_structured,
    "spec": _run_spec,
    "route": _run_route,
    "plan-check": _run_plan_check,
    "allreduce": _run_allreduce,
    "startup": _run_startup,
}
