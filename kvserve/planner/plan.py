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
        + the step's collectives over the interconnect (TP > 1, `tp_comm_seconds`)

Requests are spread evenly over the replicas (the gateway's random or
round-robin policies; cache_aware does at least as well on hit rate), so one
replica at arrival rate / R stands for the fleet. R grows until the
replica's p99 TTFT and TPOT meet the SLO; the TP size with the fewest
devices in all wins. `--roofline-json` calibrates FLOP/s and bandwidth from
`kvserve bench roofline` on this machine.
"""
from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Callable

from kvserve.bench.report import LatencyStats, format_table
from kvserve.planner.trace import TraceRequest, prompt_token_ids

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
    vocab_size: int = 0

    @classmethod
    def from_shapes(cls, shapes: Any, dtype_bytes: int) -> "ModelSpec":
        return cls(shapes.num_layers, shapes.hidden_size, shapes.num_heads, shapes.num_kv_heads,
                   shapes.head_dim, shapes.matmul_params, dtype_bytes, shapes.vocab_size)

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
    # TP across nodes (`kvserve serve --nnodes`): the network between nodes, and how many
    # nodes one replica may span (1: TP stays inside a node).
    inter_node_gbs: float = 50.0
    inter_node_latency_us: float = 20.0
    max_nodes_per_replica: int = 1

    def link(self, tp: int) -> tuple[float, float]:
        """(latency s, bytes/s) of the slowest link a TP-`tp` ring crosses."""
        if tp > self.devices_per_node:
            return self.inter_node_latency_us * 1e-6, self.inter_node_gbs * 1e9
        return self.interconnect_latency_us * 1e-6, self.interconnect_gbs * 1e9

    def tp_sizes(self) -> list[int]:
        """TP sizes a replica may use: powers of two inside a node, then whole nodes (`--nnodes` k)."""
        within = [2 ** k for k in range(11) if 2 ** k < self.devices_per_node]
        return within + [self.devices_per_node * k for k in range(1, self.max_nodes_per_replica + 1)]


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


def tp_comm_seconds(model: ModelSpec, machine: Machine, tp: int, num_tokens: int, num_sampled: int = 1) -> float:
    """The collectives of one TP step, as kvserve's TP runs them (0 at TP 1): the embedding's and
    two per layer (attention and MLP outputs) ring all-reduces of the step's activations, the
    gather of the vocabulary-sharded logits of the `num_sampled` sampled rows on rank 0, and the
    broadcast of the sampled tokens. Each costs the link latency plus its bytes over the bandwidth
    (the network between nodes when the ranks span more than one)."""
    if tp <= 1:
        return 0.0
    latency_s, bytes_per_s = machine.link(tp)
    activation_bytes = num_tokens * model.hidden_size * model.dtype_bytes
    all_reduce_s = latency_s + 2 * (tp - 1) / tp * activation_bytes / bytes_per_s
    gather_s = latency_s + (tp - 1) / tp * num_sampled * model.vocab_size * model.dtype_bytes / bytes_per_s
    return (2 * model.num_layers + 1) * all_reduce_s + gather_s + latency_s


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step of one replica at tensor-parallel size `tp`, from the roofline."""

    model: ModelSpec
    machine: Machine
    tp: int

    def seconds(self, num_tokens: int, num_context_tokens: int, num_decode_tokens: int = 0,
                num_sampled: int = 1) -> float:
        """`num_decode_tokens` (of `num_tokens`) does not change a roofline step: weights are read once;
        `num_sampled` rows of logits are gathered at TP > 1."""
        machine, model, tp = self.machine, self.model, self.tp
        bytes_read = (model.weight_bytes + num_context_tokens * model.kv_bytes_per_token) / tp
        memory_s = bytes_read / (machine.bandwidth_gbs * 1e9)
        compute_s = num_tokens * 2 * model.matmul_params / tp / (machine.tflops * 1e12)
        return (machine.step_overhead_ms / 1000 + max(memory_s, compute_s)
                + tp_comm_seconds(model, machine, tp, num_tokens, num_sampled))


def kv_tokens_per_replica(model: ModelSpec, machine: Machine, tp: int) -> int:
    """Tokens of KV the replica holds: each rank's memory left after its weight slice."""
    per_rank_bytes = machine.memory_gib * GIB * machine.memory_utilization - model.weight_bytes / tp
    # KV heads are split over the ranks, or replicated when there are fewer than ranks.
    kv_heads_per_rank = max(1, model.num_kv_heads // tp)
    per_rank_bytes_per_token = model.kv_bytes_per_token * kv_heads_per_rank / model.num_kv_heads
    return max(0, int(per_rank_bytes / per_rank_bytes_per_token))


def synthetic_trace(load: Load, rate: float, num_requests: int, seed: int) -> list[TraceRequest]:
    """Poisson arrivals; log-normal lengths; a shared prefix of `shared_prefix_ratio` of each prompt."""
    rng = random.Random(seed)
    clock, trace = 0.0, []
    for _ in range(num_requests):
        clock += rng.expovariate(rate)
        output_len = max(1, min(int(rng.lognormvariate(math.log(load.output_len_median), load.output_len_sigma)),
                                load.max_model_len // 4))
        prompt_len = max(2, min(int(rng.lognormvariate(math.log(load.prompt_len_median), load.prompt_len_sigma)),
                                load.max_model_len - output_len))
        shared = int(prompt_len * load.shared_prefix_ratio) if load.num_shared_prefixes else 0
        prefix_id = str(rng.randrange(load.num_shared_prefixes)) if shared else None
        trace.append(TraceRequest(clock, prompt_len, output_len, prefix_id, shared))
    return trace


@dataclass(frozen=True)
class SchedulerShape:
    """The replica's scheduler limits and KV block size (as `kvserve serve` flags set them)."""

    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


@dataclass
class _ReplicaRun:
    """Raw figures of one simulated replica, pooled across a fleet before summarising."""

    ttft_s: list[float]
    tpot_s: list[float]
    prefix_hits: int
    prefix_queries: int
    num_preemptions: int
    duration_s: float


def _replay(cost, num_kv_tokens: int, trace: list[TraceRequest], prompts: list[list[int]],
            shape: SchedulerShape) -> _ReplicaRun | str:
    """Replay through the real scheduler on a simulated clock; a string says why it cannot run."""
    from kvserve.planner.simulated import FakeModelRunner, create_requests, create_scheduler

    num_blocks = num_kv_tokens // shape.block_size + 1
    max_len = max(len(p) + r.output_len for p, r in zip(prompts, trace))
    if num_blocks - 1 < -(-max_len // shape.block_size):
        return f"a {max_len}-token request does not fit in {num_kv_tokens} KV tokens"
    scheduler = create_scheduler(num_blocks=num_blocks, block_size=shape.block_size,
                                 max_num_seqs=shape.max_num_seqs,
                                 max_num_batched_tokens=shape.max_num_batched_tokens,
                                 max_model_len=max_len)
    requests = create_requests(len(prompts), max_tokens=[r.output_len for r in trace], prompt_token_ids=prompts)
    runner = FakeModelRunner()
    clock, next_index, hits, queries = 0.0, 0, 0, 0
    first_token_s: dict[str, float] = {}
    last_token_s: dict[str, float] = {}
    num_tokens_out: dict[str, int] = {}
    while next_index < len(requests) or scheduler.get_num_unfinished_requests():
        while next_index < len(requests) and trace[next_index].arrival_s <= clock:
            scheduler.add_request(requests[next_index])
            next_index += 1
        if not scheduler.get_num_unfinished_requests():
            clock = trace[next_index].arrival_s
            continue
        output = scheduler.schedule()
        scheduled = [(scheduler.requests[rid], n) for rid, n in output.num_scheduled_tokens.items()
                     if rid in scheduler.requests]
        # schedule() has already advanced num_computed_tokens past this step's tokens.
        context = sum(request.num_computed_tokens for request, _ in scheduled)
        decode = sum(n for request, n in scheduled if request.num_computed_tokens - n >= request.num_prompt_tokens)
        sampled = sum(1 for request, _ in scheduled if request.num_computed_tokens >= request.num_prompt_tokens)
        clock += cost.seconds(output.total_num_scheduled_tokens, context, decode, num_sampled=max(1, sampled))
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
    ttft = [first_token_s[r.request_id] - trace[i].arrival_s for i, r in enumerate(requests)]
    tpot = [(last_token_s[r.request_id] - first_token_s[r.request_id]) / (num_tokens_out[r.request_id] - 1)
            for r in requests if num_tokens_out[r.request_id] > 1]
    return _ReplicaRun(ttft, tpot, hits, queries, scheduler.make_stats().num_preemptions, clock)


def _summarize(runs: list[_ReplicaRun], num_requests: int) -> dict[str, Any]:
    hits = sum(r.prefix_hits for r in runs)
    queries = sum(r.prefix_queries for r in runs)
    return {"feasible": True, "num_requests": num_requests, "duration_s": max(r.duration_s for r in runs),
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "ttft": LatencyStats.from_seconds([t for r in runs for t in r.ttft_s]).as_dict(),
            "tpot": LatencyStats.from_seconds([t for r in runs for t in r.tpot_s]).as_dict(),
            "num_preemptions": sum(r.num_preemptions for r in runs)}


def simulate_replica(cost, num_kv_tokens: int, trace: list[TraceRequest], *,
                     shape: SchedulerShape = SchedulerShape(), seed: int = 0) -> dict[str, Any]:
    """Replay `trace` through the real scheduler on a simulated clock; latencies and hit rate.

    `cost` is anything with `seconds(num_tokens, num_context_tokens, num_decode_tokens, num_sampled=)`:
    the roofline `StepCost`, or a measured `CalibratedStepCost`."""
    prompts = prompt_token_ids(trace, _SIMULATED_VOCAB, seed)
    run = _replay(cost, num_kv_tokens, trace, prompts, shape)
    if isinstance(run, str):
        return {"feasible": False, "reason": run}
    return _summarize([run], len(trace))


# ---------------------------------------------------------------- routing over replicas

ROUTING_POLICIES = ("round_robin", "random", "cache_aware")
# Simulating every replica of a large fleet costs too much: a slice of this many
# replicas, with the fleet's per-replica load and prefixes per replica, stands for it.
MAX_SIMULATED_REPLICAS = 8
_SIMULATED_VOCAB = 1 << 20


# sglang-router 0.3.2's defaults for its cache_aware policy.
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


def route(trace: list[TraceRequest], num_replicas: int, policy: str, seed: int = 0,
          duration_s: Callable[[TraceRequest], float] | None = None) -> list[list[int]]:
    """Indices of the requests each replica receives under the gateway's `policy`.

    cache_aware follows SGLang's Model Gateway: when the replicas' in-flight request
    counts differ by more than 64 and 1.5x, the least loaded replica takes the request;
    otherwise a replica that has seen the request's shared prefix takes it when that
    prefix is over 30% of the prompt; otherwise the replica with the smallest cache tree
    (fewest prompt tokens received). In-flight counts come from `duration_s(request)`,
    an estimate of each request's time in the engine (none given: nothing stays in flight)."""
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(ROUTING_POLICIES)}")
    assigned: list[list[int]] = [[] for _ in range(num_replicas)]
    rng = random.Random(seed)
    holders: dict[str, set[int]] = {}
    tree_tokens = [0] * num_replicas
    in_flight: list[list[float]] = [[] for _ in range(num_replicas)]  # heaps of finish times
    for index, request in enumerate(trace):
        if policy == "round_robin":
            target = index % num_replicas
        elif policy == "random":
            target = rng.randrange(num_replicas)
        else:
            for finishing in in_flight:
                while finishing and finishing[0] <= request.arrival_s:
                    heapq.heappop(finishing)
            loads = [len(finishing) for finishing in in_flight]
            known = holders.get(request.prefix_id, set()) if request.prefix_len else set()
            if max(loads) - min(loads) > BALANCE_ABS_THRESHOLD and max(loads) > min(loads) * BALANCE_REL_THRESHOLD:
                target = loads.index(min(loads))
            elif known and request.prefix_len / request.prompt_len > CACHE_THRESHOLD:
                target = min(known, key=lambda r: loads[r])
            else:
                target = tree_tokens.index(min(tree_tokens))
            if request.prefix_id is not None and request.prefix_len:
                holders.setdefault(request.prefix_id, set()).add(target)
            tree_tokens[target] += request.prompt_len
            if duration_s is not None:
                heapq.heappush(in_flight[target], request.arrival_s + duration_s(request))
        assigned[target].append(index)
    return assigned


def unloaded_duration(cost) -> Callable[[TraceRequest], float]:
    """A request's time in an idle engine: its prefill, then its decode steps alone."""
    def duration_s(request: TraceRequest) -> float:
        decode_step = cost.seconds(1, request.prompt_len + request.output_len // 2, 1, num_sampled=1)
        return cost.seconds(request.prompt_len, request.prompt_len) + (request.output_len - 1) * decode_step
    return duration_s


def _fleet_slice(trace: list[TraceRequest], num_replicas: int) -> tuple[list[TraceRequest], int]:
    """A fleet of at most MAX_SIMULATED_REPLICAS with the same requests and prefixes per replica."""
    if num_replicas <= MAX_SIMULATED_REPLICAS:
        return trace, num_replicas
    share = MAX_SIMULATED_REPLICAS / num_replicas
    prefix_ids = sorted({r.prefix_id for r in trace if r.prefix_id is not None})
    kept = set(prefix_ids[:max(1, round(len(prefix_ids) * share))])
    # With fewer prefixes than simulated replicas need, the kept ones are thinned to the share.
    keep_prefixed = min(1.0, share * len(prefix_ids) / len(kept)) if kept else 0.0
    rng = random.Random(len(trace))
    sliced = [r for r in trace
              if (r.prefix_id is None and rng.random() < share)
              or (r.prefix_id in kept and rng.random() < keep_prefixed)]
    return sliced, MAX_SIMULATED_REPLICAS


def simulate_fleet(cost, num_kv_tokens: int, trace: list[TraceRequest], num_replicas: int, policy: str, *,
                   shape: SchedulerShape = SchedulerShape(), seed: int = 0) -> dict[str, Any]:
    """Route the fleet-wide `trace` over `num_replicas` replicas and simulate each one;
    latencies pooled over all requests, the hit rate aggregated over all replicas."""
    trace, simulated = _fleet_slice(trace, num_replicas)
    prompts = prompt_token_ids(trace, _SIMULATED_VOCAB, seed)
    runs, spread = [], []
    for indices in route(trace, simulated, policy, seed, unloaded_duration(cost)):
        spread.append(len(indices))
        if not indices:
            continue
        run = _replay(cost, num_kv_tokens, [trace[i] for i in indices], [prompts[i] for i in indices], shape)
        if isinstance(run, str):
            return {"feasible": False, "reason": run}
        runs.append(run)
    return {**_summarize(runs, len(trace)), "policy": policy, "simulated_replicas": simulated,
            "requests_per_simulated_replica": spread}


def _meets(result: dict[str, Any], slo: SLO) -> bool:
    return result["feasible"] and result["ttft"]["p99_ms"] <= slo.ttft_p99_ms and \
        result["tpot"]["p99_ms"] <= slo.tpot_p99_ms


@dataclass(frozen=True)
class Workload:
    """The traffic a plan simulates: a synthetic `load`, or a recorded fleet-wide `trace`
    (then `policy` says how the gateway spreads it while searching the replica count)."""

    load: Load
    trace: tuple[TraceRequest, ...] | None = None
    policy: str = "round_robin"
    num_requests: int = 400
    seed: int = 0

    def predict(self, cost, kv_tokens: int, replicas: int, shape: SchedulerShape) -> dict[str, Any]:
        """The predicted figures of a fleet of `replicas` replicas of `cost` and `kv_tokens`."""
        if self.trace is not None:
            return simulate_fleet(cost, kv_tokens, list(self.trace), replicas, self.policy, shape=shape,
                                  seed=self.seed)
        # Replicas behind round-robin or random routing see the same traffic: one stands for all.
        trace = synthetic_trace(self.load, self.load.arrival_rate / replicas, self.num_requests, self.seed)
        return simulate_replica(cost, kv_tokens, trace, shape=shape, seed=self.seed)

    def compare_routing(self, cost, kv_tokens: int, replicas: int, shape: SchedulerShape,
                        policies: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """Per gateway policy, the whole fleet's predicted hit rate and latencies."""
        if self.trace is not None:
            trace = list(self.trace)
        else:
            simulated = min(replicas, MAX_SIMULATED_REPLICAS)
            share = simulated / replicas
            load = Load(**{**asdict(self.load), "arrival_rate": self.load.arrival_rate * share,
                           "num_shared_prefixes": max(1, round(self.load.num_shared_prefixes * share))
                           if self.load.num_shared_prefixes else 0})
            trace = synthetic_trace(load, load.arrival_rate, self.num_requests * simulated, self.seed)
        return {policy: simulate_fleet(cost, kv_tokens, trace, replicas, policy, shape=shape, seed=self.seed)
                for policy in policies}


def _fleet_entry(tp: int, replicas: int, kv_tokens: int, model: ModelSpec, machine: Machine) -> dict[str, Any]:
    return {"tp": tp, "replicas": replicas, "devices": replicas * tp,
            "nodes": math.ceil(replicas * tp / machine.devices_per_node),
            "nodes_per_replica": math.ceil(tp / machine.devices_per_node), "kv_tokens_per_replica": kv_tokens,
            "kv_memory_gib_per_replica": kv_tokens * model.kv_bytes_per_token / GIB}


def plan_for_tp(model: ModelSpec, machine: Machine, workload: Workload, slo: SLO, tp: int, cost, *,
                shape: SchedulerShape = SchedulerShape(), max_replicas: int = 4096) -> dict[str, Any]:
    """Fewest replicas at this TP size that meet the SLO (doubling, then bisection)."""
    kv_tokens = kv_tokens_per_replica(model, machine, tp)
    entry: dict[str, Any] = {"tp": tp, "kv_tokens_per_replica": kv_tokens,
                             "kv_memory_gib_per_replica": kv_tokens * model.kv_bytes_per_token / GIB}
    if kv_tokens <= 0:
        return {**entry, "feasible": False, "reason": "the weights do not fit"}
    low, high, best = 0, 1, None
    while high <= max_replicas:
        result = workload.predict(cost, kv_tokens, high, shape)
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
        result = workload.predict(cost, kv_tokens, middle, shape)
        if _meets(result, slo):
            high, best = middle, (middle, result)
        else:
            low = middle
    replicas, result = best
    return {**_fleet_entry(tp, replicas, kv_tokens, model, machine), "feasible": True, "prediction": result}


def evaluate(model: ModelSpec, machine: Machine, workload: Workload, tp: int, replicas: int, cost, *,
             shape: SchedulerShape = SchedulerShape()) -> dict[str, Any]:
    """The prediction for one given fleet: `replicas` replicas at TP `tp`."""
    kv_tokens = kv_tokens_per_replica(model, machine, tp)
    prediction = workload.predict(cost, kv_tokens, replicas, shape)
    return {**_fleet_entry(tp, replicas, kv_tokens, model, machine), "feasible": prediction["feasible"],
            "reason": prediction.get("reason"), "prediction": prediction}


def plan(model: ModelSpec, machine: Machine, workload: Workload | Load, slo: SLO, *,
         fixed: tuple[int, int] | None = None, cost_for_tp=None, shape: SchedulerShape = SchedulerShape(),
         routing_policies: tuple[str, ...] = ("round_robin", "cache_aware"), **workload_fields: Any) -> dict[str, Any]:
    """Every feasible TP size's plan, and the one with the fewest devices; with `fixed`
    (tp, replicas), only that fleet's prediction. The chosen fleet is also simulated under
    each of `routing_policies`. `cost_for_tp(tp)` gives the step-cost model (default: the roofline)."""
    if isinstance(workload, Load):
        workload = Workload(workload, **workload_fields)
    cost_for_tp = cost_for_tp or (lambda tp: StepCost(model, machine, tp))
    candidates = [tp for tp in machine.tp_sizes() if model.supports_tp(tp)]
    if fixed is not None:
        options = [evaluate(model, machine, workload, *fixed, cost_for_tp(fixed[0]), shape=shape)]
    else:
        options = [plan_for_tp(model, machine, workload, slo, tp, cost_for_tp(tp), shape=shape)
                   for tp in candidates]
    feasible = [o for o in options if o["feasible"]]
    best = min(feasible, key=lambda o: (o["devices"], o["tp"])) if feasible else None
    if best is not None and routing_policies:
        best["routing"] = workload.compare_routing(cost_for_tp(best["tp"]), best["kv_tokens_per_replica"],
                                                   best["replicas"], shape, routing_policies)
    return {"model": asdict(model), "machine": asdict(machine), "load": asdict(workload.load),
            "trace_requests": len(workload.trace) if workload.trace is not None else None,
            "scheduler": asdict(shape), "slo": asdict(slo), "num_simulated_requests": workload.num_requests,
            "options": options, "best": best}


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
        hint = ""
        if result["machine"]["max_nodes_per_replica"] == 1 and all(
                o.get("reason") == "the weights do not fit" for o in result["options"]):
            hint = " (the weights fit no single node: --max-nodes-per-replica 2 plans TP across nodes)"
        return text + "\n\nno TP size meets the SLO" + hint
    routing = best.get("routing") or {}
    if routing:
        text += "\n\n" + format_table(
            ["policy", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "TPOT p99 ms", "requests per simulated replica"],
            [[policy, f"{100 * r['prefix_hit_rate']:.1f}%", r["ttft"]["p50_ms"], r["ttft"]["p99_ms"],
              r["tpot"]["p99_ms"], " / ".join(map(str, r["requests_per_simulated_replica"]))]
             if r["feasible"] else [policy, "-", "-", "-", "-", r["reason"]] for policy, r in routing.items()],
            title=f"the chosen fleet behind the gateway ({best['replicas']} replicas)")
    return text + (f"\n\nbest: {best['replicas']} replicas x TP {best['tp']} = {best['devices']} devices "
                   f"({best['nodes']} nodes{_spans(best)}), {best['kv_memory_gib_per_replica']:.1f} GiB KV per replica, "
                   f"predicted hit rate {100 * best['prediction']['prefix_hit_rate']:.1f}%, "
                   f"TTFT p99 {best['prediction']['ttft']['p99_ms']:.0f} ms, "
                   f"TPOT p99 {best['prediction']['tpot']['p99_ms']:.1f} ms")


def _spans(option: dict[str, Any]) -> str:
    nodes = option.get("nodes_per_replica", 1)
    return f"; each replica spans {nodes} nodes: kvserve serve --nnodes {nodes}" if nodes > 1 else ""
