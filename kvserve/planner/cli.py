"""`kvserve plan` on the command line: flags, the model's shapes, the cost model, the output."""
from __future__ import annotations

import json

from kvserve.planner.plan import (ROUTING_POLICIES, SLO, Load, Machine, ModelSpec, SchedulerShape, Workload,
                                format_result, machine_from_roofline, plan)


def add_plan_arguments(parser) -> None:
    """Flags of `kvserve plan`."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="HF model directory, .gguf file, or a config.json (default: the default model)")
    model.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight and KV value (default 2)")
    machine = parser.add_argument_group("machine (one device) and its step cost")
    machine.add_argument("--roofline-json", default=None, metavar="PATH",
                         help="calibrate FLOP/s and bandwidth from `kvserve bench roofline` output")
    machine.add_argument("--roofline-dtype", default="float32", help="dtype row of the roofline JSON")
    machine.add_argument("--calibration-json", default=None, metavar="PATH",
                         help="step cost measured by `kvserve bench plan-check` on this machine and model "
                              "(replaces the roofline's step cost; memory still sizes the KV pool)")
    machine.add_argument("--memory-gib", type=float, default=80.0, help="device memory (default 80)")
    machine.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth GB/s (default 3350)")
    machine.add_argument("--tflops", type=float, default=None, help="dense matmul TFLOP/s (default 990)")
    machine.add_argument("--interconnect-gbs", type=float, default=None, help="per-device link GB/s (default 100)")
    machine.add_argument("--interconnect-latency-us", type=float, default=None, help="per all-reduce (default 10)")
    machine.add_argument("--interconnect-json", default=None, metavar="PATH",
                         help="link latency and bandwidth measured by `kvserve bench allreduce` or "
                              "`kvserve bench plan-check --tp N` (the flags above override it)")
    machine.add_argument("--devices-per-node", type=int, default=None, help="devices per node (default 8)")
    machine.add_argument("--max-nodes-per-replica", type=int, default=None,
                         help="nodes one replica's TP may span (kvserve serve --nnodes; default 1)")
    machine.add_argument("--inter-node-gbs", type=float, default=None,
                         help="per-device network GB/s between nodes, for TP across nodes (default 50)")
    machine.add_argument("--inter-node-latency-us", type=float, default=None,
                         help="per collective between nodes (default 20)")
    machine.add_argument("--memory-utilization", type=float, default=None, help="share of memory used (0.9)")
    machine.add_argument("--step-overhead-ms", type=float, default=None, help="fixed cost per step (default 2)")
    replica = parser.add_argument_group("replica scheduler (as `kvserve serve` flags set them)")
    replica.add_argument("--block-size", type=int, default=16)
    replica.add_argument("--max-num-seqs", type=int, default=256)
    replica.add_argument("--max-num-batched-tokens", type=int, default=8192)
    load = parser.add_argument_group("load and SLO")
    load.add_argument("--trace", default=None, metavar="JSONL",
                      help="a recorded fleet-wide trace instead of the synthetic load (format in docs/capacity_planning.md)")
    load.add_argument("--policy", default="round_robin", choices=ROUTING_POLICIES,
                      help="with --trace: how the gateway spreads it while sizing the fleet")
    load.add_argument("--routing-policies", default="round_robin,cache_aware",
                      help="gateway policies to compare on the chosen fleet ('' to skip)")
    load.add_argument("--arrival-rate", type=float, default=None, help="requests per second, fleet-wide")
    load.add_argument("--prompt-len", type=int, default=512, help="median prompt tokens (log-normal)")
    load.add_argument("--output-len", type=int, default=128, help="median output tokens (log-normal)")
    load.add_argument("--len-sigma", type=float, default=0.6, help="log-normal sigma of both lengths")
    load.add_argument("--shared-prefix-ratio", type=float, default=0.5, help="share of a prompt that is shared")
    load.add_argument("--num-shared-prefixes", type=int, default=4, help="distinct shared prefixes")
    load.add_argument("--max-model-len", type=int, default=4096)
    load.add_argument("--ttft-p99-ms", type=float, required=True)
    load.add_argument("--tpot-p99-ms", type=float, required=True)
    parser.add_argument("--num-requests", type=int, default=400, help="simulated requests per replica and trial")
    parser.add_argument("--tp", type=int, default=None, help="with --replicas: predict only this fleet")
    parser.add_argument("--replicas", type=int, default=None, help="with --tp: predict only this fleet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, metavar="PATH", help="also write the plan as JSON")


def model_shapes_from_path(path: str | None):
    """The decoder's shapes from an HF directory, a .gguf file or a bare config.json."""
    from kvserve.bench.model_info import ModelShapes, model_shapes, resolve_model_path

    if path and path.endswith(".json"):
        try:
            config = json.loads(open(path).read())
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            shapes = ModelShapes(config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                                 config["num_attention_heads"],
                                 config.get("num_key_value_heads") or config["num_attention_heads"],
                                 head_dim, config["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SystemExit(f"kvserve plan: error: {path} is not a readable model config.json "
                             f"({exc.__class__.__name__}: {exc})") from None
    else:
        shapes = model_shapes(resolve_model_path(path))
    return shapes


def model_spec_from_path(path: str | None, dtype_bytes: int) -> ModelSpec:
    return ModelSpec.from_shapes(model_shapes_from_path(path), dtype_bytes)


def _load_json(path: str, loader):
    try:
        return loader(path), json.loads(open(path).read())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kvserve plan: error: {exc}") from None


def _calibrated_cost(path: str, shapes, model: ModelSpec, machine: Machine):
    """`cost_for_tp` from a plan-check calibration, refused when it was measured on another model.
    A `plan-check --tp N` JSON also carries the measured TP cost, used for every TP > 1."""
    from dataclasses import asdict

    from kvserve.planner.calibrate import load_calibration
    from kvserve.planner.tp_cost import TPCost, tp_step_cost

    calibration, payload = _load_json(path, load_calibration)
    result = payload.get("result", payload)
    measured_on = result.get("calibration", {}).get("model_shapes")
    if measured_on is not None and measured_on != asdict(shapes):
        raise SystemExit(f"kvserve plan: error: {path} was measured on a model of shapes {measured_on}, not "
                         f"{asdict(shapes)}; calibrate this model (kvserve bench plan-check --model ...) "
                         "or plan it with the roofline (--roofline-json)")
    tp_cost = TPCost.from_json(result["tp_cost"]) if "tp_cost" in result else None
    return lambda tp: tp_step_cost(calibration, tp, model, machine, tp_cost)


def _measured_link(args) -> dict[str, float]:
    """Interconnect fields from --interconnect-json, or from a --calibration-json of `plan-check --tp`."""
    from kvserve.planner.interconnect import load_interconnect

    path = args.interconnect_json
    if path is None and args.calibration_json:
        payload = _load_json(args.calibration_json, lambda p: None)[1]
        if "interconnect" in payload.get("result", payload):
            path = args.calibration_json
    if path is None:
        return {}
    link = _load_json(path, load_interconnect)[0]
    return {"interconnect_gbs": link.bandwidth_gbs, "interconnect_latency_us": link.latency_us}


def _machine(args) -> Machine:
    overrides = {"memory_gib": args.memory_gib, **_measured_link(args),
                 "devices_per_node": args.devices_per_node, "memory_utilization": args.memory_utilization,
                 "step_overhead_ms": args.step_overhead_ms, "max_nodes_per_replica": args.max_nodes_per_replica,
                 "inter_node_gbs": args.inter_node_gbs, "inter_node_latency_us": args.inter_node_latency_us}
    for name in ("interconnect_gbs", "interconnect_latency_us"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.roofline_json:
        overrides.update({"bandwidth_gbs": args.bandwidth_gbs, "tflops": args.tflops})
        return machine_from_roofline(args.roofline_json, args.roofline_dtype, **overrides)
    overrides.update({"bandwidth_gbs": args.bandwidth_gbs or 3350.0, "tflops": args.tflops or 990.0})
    return Machine(**{k: v for k, v in overrides.items() if v is not None})


def _step_cost_label(args) -> str:
    if not args.calibration_json:
        return "roofline"
    payload = _load_json(args.calibration_json, lambda p: None)[1]
    measured_tp = "tp_cost" in payload.get("result", payload)
    return "calibrated: " + args.calibration_json + (" (TP cost measured)" if measured_tp else "")


# (flag, lowest allowed value, whether the lowest is allowed): None values (unset flags) pass.
_PLAN_BOUNDS = (("arrival_rate", 0, False), ("num_requests", 1, True), ("ttft_p99_ms", 0, False),
                ("tpot_p99_ms", 0, False), ("memory_gib", 0, False), ("bandwidth_gbs", 0, False),
                ("tflops", 0, False), ("interconnect_gbs", 0, False), ("interconnect_latency_us", 0, True),
                ("devices_per_node", 1, True), ("memory_utilization", 0, False), ("step_overhead_ms", 0, True),
                ("block_size", 1, True), ("max_num_seqs", 1, True), ("max_num_batched_tokens", 1, True),
                ("prompt_len", 1, True), ("output_len", 1, True), ("len_sigma", 0, True),
                ("shared_prefix_ratio", 0, True), ("num_shared_prefixes", 0, True), ("max_model_len", 2, True),
                ("dtype_bytes", 1, True), ("tp", 1, True), ("replicas", 1, True),
                ("max_nodes_per_replica", 1, True), ("inter_node_gbs", 0, False), ("inter_node_latency_us", 0, True))


def check_bounds(args, bounds, prog: str) -> None:
    """A one-line error for the first flag out of its range (see `_PLAN_BOUNDS`)."""
    for name, lowest, inclusive in bounds:
        value = getattr(args, name, None)
        if value is not None and (value < lowest or (value == lowest and not inclusive)):
            relation = ">=" if inclusive else ">"
            raise SystemExit(f"{prog}: error: --{name.replace('_', '-')} must be {relation} {lowest}, got {value}")


def _check_plan_args(args, model: ModelSpec) -> None:
    """Bad flags are refused before anything is simulated."""
    if args.trace is None and args.arrival_rate is None:
        raise SystemExit("kvserve plan: error: give --arrival-rate (a synthetic load) or --trace (a recorded one)")
    check_bounds(args, _PLAN_BOUNDS, "kvserve plan")
    if args.shared_prefix_ratio > 1 or (args.memory_utilization or 0) > 1:
        raise SystemExit("kvserve plan: error: --shared-prefix-ratio and --memory-utilization are shares (0..1)")
    if (args.tp is None) != (args.replicas is None):
        raise SystemExit("kvserve plan: error: --tp and --replicas go together (one given fleet); "
                         "give neither to search every TP size")
    if args.tp is not None and not model.supports_tp(args.tp):
        raise SystemExit(f"kvserve plan: error: --tp {args.tp} does not split the model's {model.num_heads} "
                         f"attention heads and {model.num_kv_heads} KV heads")


def run_plan(args) -> int:
    """`kvserve plan`: print the plan (and write it as JSON)."""
    from kvserve.planner.trace import TraceError, read_trace

    shapes = model_shapes_from_path(args.model)
    model = ModelSpec.from_shapes(shapes, args.dtype_bytes)
    _check_plan_args(args, model)
    machine = _machine(args)
    load = Load(args.arrival_rate or 0.0, args.prompt_len, args.len_sigma, args.output_len, args.len_sigma,
                args.shared_prefix_ratio, args.num_shared_prefixes, args.max_model_len)
    try:
        trace = tuple(read_trace(args.trace)) if args.trace else None
    except (OSError, TraceError) as exc:
        raise SystemExit(f"kvserve plan: error: {exc}") from None
    cost_for_tp = _calibrated_cost(args.calibration_json, shapes, model, machine) if args.calibration_json else None
    policies = tuple(p.strip() for p in args.routing_policies.split(",") if p.strip())
    unknown = sorted(set(policies) - set(ROUTING_POLICIES))
    if unknown:
        raise SystemExit(f"kvserve plan: error: unknown routing policies {unknown}; known: {list(ROUTING_POLICIES)}")
    workload = Workload(load, trace, args.policy, args.num_requests, args.seed)
    result = plan(model, machine, workload, SLO(args.ttft_p99_ms, args.tpot_p99_ms),
                  fixed=(args.tp, args.replicas) if args.tp else None, cost_for_tp=cost_for_tp,
                  shape=SchedulerShape(args.block_size, args.max_num_seqs, args.max_num_batched_tokens),
                  routing_policies=policies)
    result["step_cost"] = _step_cost_label(args)
    print(format_result(result))
    if args.output_json:
        from kvserve.bench.report import write_json
        print(f"\nJSON: {write_json(args.output_json, result)}")
    return 0
