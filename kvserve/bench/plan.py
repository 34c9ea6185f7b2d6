"""`kvserve plan`: capacity planning on paper, with the real scheduler and KV manager.

Given a model's shapes, a machine (device memory, memory bandwidth, matmul
FLOP/s, interconnect), a target load (Poisson arrivals, log-normal prompt
and output lengths, a share of each prompt that is one of a few shared
prefixes) and an SLO (TTFT and TPOT p99), it answers: how many replicas at
which TP size, how much KV memory each replica has, and the predicted
prefix-hit rate and latencies.

For each TP size it sizes one replica's KV pool from the memory left after
the weights, then replays a synthetic trace through kvserve's own Scheduler
and KVCacheManager (the FakeModelRunner stands in for the model) on a
simulated clock. Each step advances the clock by a step-cost model:

    t = overhead + max(weights/TP + KV read/TP) / bandwidth  vs  tokens*FLOPs/TP / FLOP/s
        + 2 all-reduces per layer over the interconnect (TP > 1)

Requests are spread evenly over the replicas (the gateway's random or
round-robin policies; cache_aware does at least as well on hit rate), so one
replica at arrival rate / R stands for the fleet. R grows until the
replica's p99 TTFT and TPOT meet the SLO; the TP size with the fewest
devices in all wins. `--roofline-json` calibrates FLOP/s and bandwidth from
`kvserve bench roofline` on this machine.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from kvserve.bench.report import LatencyStats, format_table

GIB = 1024 ** 3


@dataclass(frozen=True)
class ModelSpec:
    """What the cost model needs of a decoder."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    matmul_params: int
    dtype_bytes: int = 2

    @classmethod
    def from_shapes(cls, shapes: Any, dtype_bytes: int) -> "ModelSpec":
        return cls(shapes.num_layers, shapes.hidden_size, shapes.num_heads, shapes.num_kv_heads,
                   shapes.head_dim, shapes.matmul_params, dtype_bytes)

    @property
    def weight_bytes(self) -> int:
        return self.matmul_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def supports_tp(self, tp: int) -> bool:
        kv = self.num_kv_heads
        return self.num_heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0)


@dataclass(frozen=True)
class Machine:
    """One device (GPU, or a CPU socket) and the links between devices."""

    memory_gib: float
    bandwidth_gbs: float
    tflops: float
    interconnect_gbs: float = 100.0
    interconnect_latency_us: float = 10.0
    devices_per_node: int = 8
    memory_utilization: float = 0.9
    step_overhead_ms: float = 2.0


@dataclass(frozen=True)
class Load:
    """The traffic to serve."""

    arrival_rate: float
    prompt_len_median: int = 512
    prompt_len_sigma: float = 0.6
    output_len_median: int = 128
    output_len_sigma: float = 0.6
    shared_prefix_ratio: float = 0.5
    num_shared_prefixes: int = 4
    max_model_len: int = 4096


@dataclass(frozen=True)
class SLO:
    ttft_p99_ms: float
    tpot_p99_ms: float


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step of one replica at tensor-parallel size `tp`."""

    model: ModelSpec
    machine: Machine
    tp: int

    def seconds(self, num_tokens: int, num_context_tokens: int) -> float:
        machine, model, tp = self.machine, self.model, self.tp
        bytes_read = (model.weight_bytes + num_context_tokens * model.kv_bytes_per_token) / tp
        memory_s = bytes_read / (machine.bandwidth_gbs * 1e9)
        compute_s = num_tokens * 2 * model.matmul_params / tp / (machine.tflops * 1e12)
        comm_s = 0.0
        if tp > 1:
            message_bytes = num_tokens * model.hidden_size * model.dtype_bytes
            ring_s = 2 * (tp - 1) / tp * message_bytes / (machine.interconnect_gbs * 1e9)
            comm_s = 2 * model.num_layers * (machine.interconnect_latency_us * 1e-6 + ring_s)
        return machine.step_overhead_ms / 1000 + max(memory_s, compute_s) + comm_s


def kv_tokens_per_replica(model: ModelSpec, machine: Machine, tp: int) -> int:
    """Tokens of KV the replica holds: each rank's memory left after its weight slice."""
    per_rank_bytes = machine.memory_gib * GIB * machine.memory_utilization - model.weight_bytes / tp
    # KV heads are split over the ranks, or replicated when there are fewer than ranks.
    kv_heads_per_rank = max(1, model.num_kv_heads // tp)
    per_rank_bytes_per_token = model.kv_bytes_per_token * kv_heads_per_rank / model.num_kv_heads
    return max(0, int(per_rank_bytes / per_rank_bytes_per_token))


@dataclass
class _Trace:
    arrivals_s: list[float]
    prompts: list[list[int]]
    output_lens: list[int]


def synthetic_trace(load: Load, rate: float, num_requests: int, seed: int) -> _Trace:
    """Poisson arrivals; log-normal lengths; a shared prefix of `shared_prefix_ratio` of each prompt."""
    rng = random.Random(seed)
    prefixes = [[1000 + 997 * p + i for i in range(load.max_model_len)] for p in range(load.num_shared_prefixes)]
    clock, arrivals, prompts, outputs = 0.0, [], [], []
    for index in range(num_requests):
        clock += rng.expovariate(rate)
        output_len = max(1, min(int(rng.lognormvariate(math.log(load.output_len_median), load.output_len_sigma)),
                                load.max_model_len // 4))
        prompt_len = max(2, min(int(rng.lognormvariate(math.log(load.prompt_len_median), load.prompt_len_sigma)),
                                load.max_model_len - output_len))
        shared = int(prompt_len * load.shared_prefix_ratio) if load.num_shared_prefixes else 0
        prefix = prefixes[rng.randrange(load.num_shared_prefixes)][:shared] if shared else []
        unique = [100_000 + 7919 * index + i for i in range(prompt_len - len(prefix))]
        arrivals.append(clock)
        prompts.append(prefix + unique)
        outputs.append(output_len)
    return _Trace(arrivals, prompts, outputs)


def simulate_replica(cost: StepCost, num_kv_tokens: int, trace: _Trace, *, block_size: int = 16,
                     max_num_seqs: int = 256, max_num_batched_tokens: int = 8192) -> dict[str, Any]:
    """Replay `trace` through the real scheduler on a simulated clock; latencies and hit rate."""
    from kvserve.testing import FakeModelRunner, create_requests, create_scheduler

    num_blocks = num_kv_tokens // block_size + 1
    max_len = max(len(p) + o for p, o in zip(trace.prompts, trace.output_lens))
    if num_blocks - 1 < -(-max_len // block_size):
        return {"feasible": False, "reason": f"a {max_len}-token request does not fit in {num_kv_tokens} KV tokens"}
    scheduler = create_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len)
    requests = create_requests(len(trace.prompts), max_tokens=trace.output_lens, prompt_token_ids=trace.prompts)
    runner = FakeModelRunner()
    clock, next_index = 0.0, 0
    first_token_s: dict[str, float] = {}
    last_token_s: dict[str, float] = {}
    num_tokens_out: dict[str, int] = {}
    hits = queries = 0
    while next_index < len(requests) or scheduler.get_num_unfinished_requests():
        while next_index < len(requests) and trace.arrivals_s[next_index] <= clock:
            scheduler.add_request(requests[next_index])
            next_index += 1
        if not scheduler.get_num_unfinished_requests():
            clock = trace.arrivals_s[next_index]
            continue
        output = scheduler.schedule()
        context = sum(scheduler.requests[rid].num_computed_tokens + n
                      for rid, n in output.num_scheduled_tokens.items() if rid in scheduler.requests)
        clock += cost.seconds(output.total_num_scheduled_tokens, context)
        runner_output = runner.execute(output)
        scheduler.update_from_output(output, runner_output)
        stats = scheduler.make_stats()
        hits += stats.prefix_cache_hits
        queries += stats.prefix_cache_queries
        for rid, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            if tokens:
                first_token_s.setdefault(rid, clock)
                last_token_s[rid] = clock
                num_tokens_out[rid] = num_tokens_out.get(rid, 0) + len(tokens)
    ttft = [first_token_s[r.request_id] - trace.arrivals_s[i] for i, r in enumerate(requests)]
    tpot = [(last_token_s[r.request_id] - first_token_s[r.request_id]) / (num_tokens_out[r.request_id] - 1)
            for r in requests if num_tokens_out[r.request_id] > 1]
    return {"feasible": True, "num_requests": len(requests), "duration_s": clock,
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "ttft": LatencyStats.from_seconds(ttft).as_dict(), "tpot": LatencyStats.from_seconds(tpot).as_dict(),
            "num_preemptions": scheduler.make_stats().num_preemptions}


def _meets(result: dict[str, Any], slo: SLO) -> bool:
    return result["feasible"] and result["ttft"]["p99_ms"] <= slo.ttft_p99_ms and \
        result["tpot"]["p99_ms"] <= slo.tpot_p99_ms


def plan_for_tp(model: ModelSpec, machine: Machine, load: Load, slo: SLO, tp: int, *,
                num_requests: int, seed: int, max_replicas: int = 4096) -> dict[str, Any]:
    """Fewest replicas at this TP size that meet the SLO (doubling, then bisection)."""
    cost = StepCost(model, machine, tp)
    kv_tokens = kv_tokens_per_replica(model, machine, tp)
    entry: dict[str, Any] = {"tp": tp, "kv_tokens_per_replica": kv_tokens,
                             "kv_memory_gib_per_replica": kv_tokens * model.kv_bytes_per_token / GIB}
    if kv_tokens <= 0:
        return {**entry, "feasible": False, "reason": "the weights do not fit"}

    def run(replicas: int) -> dict[str, Any]:
        trace = synthetic_trace(load, load.arrival_rate / replicas, num_requests, seed)
        return simulate_replica(cost, kv_tokens, trace)

    low, high, best = 0, 1, None
    while high <= max_replicas:
        result = run(high)
        if not result["feasible"]:
            return {**entry, "feasible": False, "reason": result["reason"]}
        if _meets(result, slo):
            best = (high, result)
            break
        low, high = high, high * 2
    if best is None:
        return {**entry, "feasible": False, "reason": f"SLO not met with {max_replicas} replicas"}
    while high - low > 1:
        middle = (low + high) // 2
        result = run(middle)
        if _meets(result, slo):
            high, best = middle, (middle, result)
        else:
            low = middle
    replicas, result = best
    return {**entry, "feasible": True, "replicas": replicas, "devices": replicas * tp,
            "nodes": math.ceil(replicas * tp / machine.devices_per_node), "prediction": result}


def evaluate(model: ModelSpec, machine: Machine, load: Load, tp: int, replicas: int, *,
             num_requests: int, seed: int) -> dict[str, Any]:
    """The prediction for one given fleet: `replicas` replicas at TP `tp`."""
    kv_tokens = kv_tokens_per_replica(model, machine, tp)
    trace = synthetic_trace(load, load.arrival_rate / replicas, num_requests, seed)
    prediction = simulate_replica(StepCost(model, machine, tp), kv_tokens, trace)
    return {"tp": tp, "replicas": replicas, "devices": replicas * tp,
            "nodes": math.ceil(replicas * tp / machine.devices_per_node), "kv_tokens_per_replica": kv_tokens,
            "kv_memory_gib_per_replica": kv_tokens * model.kv_bytes_per_token / GIB,
            "feasible": prediction["feasible"], "reason": prediction.get("reason"), "prediction": prediction}


def plan(model: ModelSpec, machine: Machine, load: Load, slo: SLO, *, num_requests: int = 400,
         seed: int = 0, fixed: tuple[int, int] | None = None) -> dict[str, Any]:
    """Every feasible TP size's plan, and the one with the fewest devices; with `fixed`
    (tp, replicas), only that fleet's prediction."""
    candidates = [tp for tp in (1, 2, 4, 8, 16) if tp <= machine.devices_per_node and model.supports_tp(tp)]
    if fixed is not None:
        options = [evaluate(model, machine, load, *fixed, num_requests=num_requests, seed=seed)]
    else:
        options = [plan_for_tp(model, machine, load, slo, tp, num_requests=num_requests, seed=seed)
                   for tp in candidates]
    feasible = [o for o in options if o["feasible"]]
    best = min(feasible, key=lambda o: (o["devices"], o["tp"])) if feasible else None
    return {"model": asdict(model), "machine": asdict(machine), "load": asdict(load), "slo": asdict(slo),
            "num_simulated_requests": num_requests, "options": options, "best": best}


def machine_from_roofline(path: str, dtype: str, **overrides: Any) -> Machine:
    """This machine as `kvserve bench roofline` measured it: FLOP/s at its largest batch,
    and the bandwidth torch's one-token matmuls actually reach."""
    result = json.loads(open(path).read())["result"]
    entry = result["by_dtype"][dtype]
    batched = max(entry["matmul"], key=lambda p: p["m"])
    single = min(entry["matmul"], key=lambda p: p["m"])
    fields = {"bandwidth_gbs": single["weight_read_gb_per_s"], "tflops": batched["gflops"] / 1000}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return Machine(**fields)


def format_result(result: dict[str, Any]) -> str:
    rows = []
    for option in result["options"]:
        if not option["feasible"]:
            rows.append([option["tp"], "-", "-", f"{option['kv_memory_gib_per_replica']:.1f}", "-", "-", "-",
                         "-", "-", option["reason"]])
            continue
        prediction = option["prediction"]
        rows.append([option["tp"], option["replicas"], option["devices"],
                     f"{option['kv_memory_gib_per_replica']:.1f}", f"{100 * prediction['prefix_hit_rate']:.1f}%",
                     prediction["ttft"]["p50_ms"], prediction["ttft"]["p99_ms"], prediction["tpot"]["p50_ms"],
                     prediction["tpot"]["p99_ms"], ""])
    text = format_table(["TP", "replicas", "devices", "KV GiB/replica", "hit rate", "TTFT p50 ms", "TTFT p99 ms",
                         "TPOT p50 ms", "TPOT p99 ms", "note"], rows, title="plan: one row per TP size")
    best = result["best"]
    if best is None:
        return text + "\n\nno TP size meets the SLO"
    return text + (f"\n\nbest: {best['replicas']} replicas x TP {best['tp']} = {best['devices']} devices "
                   f"({best['nodes']} nodes), {best['kv_memory_gib_per_replica']:.1f} GiB KV per replica, "
                   f"predicted hit rate {100 * best['prediction']['prefix_hit_rate']:.1f}%, "
                   f"TTFT p99 {best['prediction']['ttft']['p99_ms']:.0f} ms, "
                   f"TPOT p99 {best['prediction']['tpot']['p99_ms']:.1f} ms")


# ---------------------------------------------------------------- command line

def add_plan_arguments(parser) -> None:
    """Flags of `kvserve plan`."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="HF model directory, .gguf file, or a config.json (default: the default model)")
    model.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight and KV value (default 2)")
    machine = parser.add_argument_group("machine (one device)")
    machine.add_argument("--roofline-json", default=None, metavar="PATH",
                         help="calibrate FLOP/s and bandwidth from `kvserve bench roofline` output")
    machine.add_argument("--roofline-dtype", default="float32", help="dtype row of the roofline JSON")
    machine.add_argument("--memory-gib", type=float, default=80.0, help="device memory (default 80)")
    machine.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth GB/s (default 3350)")
    machine.add_argument("--tflops", type=float, default=None, help="dense matmul TFLOP/s (default 990)")
    machine.add_argument("--interconnect-gbs", type=float, default=None, help="per-device link GB/s (default 100)")
    machine.add_argument("--interconnect-latency-us", type=float, default=None, help="per all-reduce (default 10)")
    machine.add_argument("--devices-per-node", type=int, default=None, help="largest TP size (default 8)")
    machine.add_argument("--memory-utilization", type=float, default=None, help="share of memory used (0.9)")
    machine.add_argument("--step-overhead-ms", type=float, default=None, help="fixed cost per step (default 2)")
    load = parser.add_argument_group("load and SLO")
    load.add_argument("--arrival-rate", type=float, required=True, help="requests per second, fleet-wide")
    load.add_argument("--prompt-len", type=int, default=512, help="median prompt tokens (log-normal)")
    load.add_argument("--output-len", type=int, default=128, help="median output tokens (log-normal)")
    load.add_argument("--len-sigma", type=float, default=0.6, help="log-normal sigma of both lengths")
    load.add_argument("--shared-prefix-ratio", type=float, default=0.5, help="share of a prompt that is shared")
    load.add_argument("--num-shared-prefixes", type=int, default=4, help="distinct shared prefixes")
    load.add_argument("--max-model-len", type=int, default=4096)
    load.add_argument("--ttft-p99-ms", type=float, required=True)
    load.add_argument("--tpot-p99-ms", type=float, required=True)
    parser.add_argument("--num-requests", type=int, default=400, help="simulated requests per trial")
    parser.add_argument("--tp", type=int, default=None, help="with --replicas: predict only this fleet")
    parser.add_argument("--replicas", type=int, default=None, help="with --tp: predict only this fleet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, metavar="PATH", help="also write the plan as JSON")


def model_spec_from_path(path: str | None, dtype_bytes: int) -> ModelSpec:
    from kvserve.bench.model_info import ModelShapes, model_shapes, resolve_model_path

    if path and path.endswith(".json"):
        config = json.loads(open(path).read())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        shapes = ModelShapes(config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                             config["num_attention_heads"],
                             config.get("num_key_value_heads") or config["num_attention_heads"],
                             head_dim, config["vocab_size"])
    else:
        shapes = model_shapes(resolve_model_path(path))
    return ModelSpec.from_shapes(shapes, dtype_bytes)


def run_plan(args) -> int:
    """`kvserve plan`: print the plan (and write it as JSON)."""
    overrides = {"memory_gib": args.memory_gib, "interconnect_gbs": args.interconnect_gbs,
                 "interconnect_latency_us": args.interconnect_latency_us,
                 "devices_per_node": args.devices_per_node, "memory_utilization": args.memory_utilization,
                 "step_overhead_ms": args.step_overhead_ms}
    if args.roofline_json:
        overrides.update({"bandwidth_gbs": args.bandwidth_gbs, "tflops": args.tflops})
        machine = machine_from_roofline(args.roofline_json, args.roofline_dtype, **overrides)
    else:
        overrides.update({"bandwidth_gbs": args.bandwidth_gbs or 3350.0, "tflops": args.tflops or 990.0})
        machine = Machine(**{k: v for k, v in overrides.items() if v is not None})
    load = Load(args.arrival_rate, args.prompt_len, args.len_sigma, args.output_len, args.len_sigma,
                args.shared_prefix_ratio, args.num_shared_prefixes, args.max_model_len)
    result = plan(model_spec_from_path(args.model, args.dtype_bytes), machine, load,
                  SLO(args.ttft_p99_ms, args.tpot_p99_ms), num_requests=args.num_requests, seed=args.seed,
                  fixed=(args.tp, args.replicas) if args.tp and args.replicas else None)
    print(format_result(result))
    if args.output_json:
        from kvserve.bench.report import write_json
        print(f"\nJSON: {write_json(args.output_json, result)}")
    return 0
