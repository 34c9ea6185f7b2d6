"""Routing benchmark: N kvserve replicas behind SGLang's Model Gateway, one run per policy.

The workload is multi-tenant chat: `num_users` users, each bound to one of
`num_system_prompts` long system prompts, each holding a conversation of
`turns` turns (a turn resends the whole history, as chat clients do). Users
run concurrently (at most `concurrency` requests in flight), so tenants
interleave at the replicas. The same replicas serve every policy; each
policy's run salts its system prompts so no run reuses another's cache.

Per policy it reports: the aggregate prefix-hit rate (cached prompt tokens /
prompt tokens, from each response's `usage`, and the replicas' own counters),
TTFT p50/p99, output tokens/s, and the requests each replica served (from
its /metrics). With `kill_replica_after` the last replica is SIGKILLed once
that many requests have finished: the gateway's retries and health checks
take over, and requests that still fail are counted, not hidden.

Each policy's run is also written as a request trace (`trace_out`: one JSONL per
policy, in the format `kvserve plan --trace` reads, see kvserve/planner/trace.py):
every request's send time, its prompt as the token ids the server saw (the
chat rendered by a replica's /tokenize after the timed run), the output tokens
asked for, and its system prompt as `prefix_id` with `prefix_len` the tokens it
shares with that tenant's first prompt. A route run can so be re-planned.
"""
from __future__ import annotations

import asyncio
import logging
import random
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvserve.bench.replicas import (GATEWAY_POLICIES, LocalProcess, gateway_available, start_gateway,
                                    start_replica)
from kvserve.bench.report import LatencyStats, format_table
from kvserve.bench.serve import RequestResult, stream_one
from kvserve.planner.trace import TraceRequest, write_trace

logger = logging.getLogger(__name__)

_TOPICS = ("billing", "travel", "cooking", "astronomy", "gardening", "law", "medicine", "music")
_FILLER = ("answer briefly and politely keep the tone friendly cite the policy when relevant never invent "
           "facts ask a clarifying question when the request is ambiguous and summarise at the end").split()

# Counter names on each replica's /metrics: requests finished, prefix-cache queries and hits.
_REQUESTS_METRIC = "vllm:request_success"
_PREFIX_QUERIES_METRIC = "vllm:prefix_cache_queries"
_PREFIX_HITS_METRIC = "vllm:prefix_cache_hits"


@dataclass
class RouteBenchConfig:
    """Replicas, gateway policies and the multi-tenant chat workload."""

    num_replicas: int = 2
    policies: tuple[str, ...] = GATEWAY_POLICIES
    num_users: int = 12
    num_system_prompts: int = 4
    system_prompt_words: int = 240
    turns: int = 2
    max_tokens: int = 12
    concurrency: int = 4
    seed: int = 0
    served_model_name: str = "kvserve-route"
    replica_flags: tuple[str, ...] = ("--max-model-len", "1024", "--kv-cache-memory", "48MiB")
    replica_threads: int | None = 1
    kill_replica_after: int | None = None
    timeout_s: float = 300.0
    trace_out: str | None = None  # "<stem>.jsonl": each policy's trace goes to "<stem>.<policy>.jsonl"

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in GATEWAY_POLICIES]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; choose from {', '.join(GATEWAY_POLICIES)}")
        if self.num_replicas < 1 or self.num_users < 1 or self.turns < 1 or self.concurrency < 1:
            raise ValueError("num_replicas, num_users, turns and concurrency must be >= 1")
        if not 1 <= self.num_system_prompts <= self.num_users:
            raise ValueError("num_system_prompts must be between 1 and num_users")
        if "power_of_two" in self.policies and self.num_replicas < 2:
            raise ValueError("the power_of_two policy needs at least 2 replicas")
        if self.kill_replica_after is not None and self.num_replicas < 2:
            raise ValueError("killing a replica needs at least 2 replicas")
        if self.kill_replica_after is not None and not 1 <= self.kill_replica_after < self.num_requests:
            raise ValueError(f"kill_replica_after must be between 1 and {self.num_requests - 1} "
                             f"(the run has {self.num_requests} requests)")
        if self.max_tokens < 1 or self.system_prompt_words < 1:
            raise ValueError("max_tokens and system_prompt_words must be >= 1")

    @property
    def num_requests(self) -> int:
        return self.num_users * self.turns


@dataclass
class ReplicaCounters:
    """Cumulative counters read from one replica's /metrics."""

    requests: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0

    def minus(self, earlier: "ReplicaCounters") -> "ReplicaCounters":
        return ReplicaCounters(self.requests - earlier.requests, self.prefix_queries - earlier.prefix_queries,
                               self.prefix_hits - earlier.prefix_hits)


@dataclass
class Conversation:
    """One user's chat: a system prompt and the questions of each turn."""

    user: int
    system_prompt: str
    questions: list[str]
    tenant: int = 0  # which system prompt
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class SentChat:
    """One chat request as sent: when (seconds from the run's start), its messages, its tenant."""

    sent_s: float
    messages: list[dict[str, str]]
    tenant: int


def system_prompts(config: RouteBenchConfig, salt: str) -> list[str]:
    """`num_system_prompts` long, distinct prompts; `salt` makes them unique to one run."""
    prompts = []
    for index in range(config.num_system_prompts):
        rng = random.Random(config.seed * 1000 + index)
        topic = _TOPICS[index % len(_TOPICS)]
        words = [rng.choice(_FILLER) for _ in range(config.system_prompt_words)]
        prompts.append(f"[{salt}] You are the {topic} assistant number {index}. " + " ".join(words))
    return prompts


def conversations(config: RouteBenchConfig, salt: str) -> list[Conversation]:
    """Every user's conversation, in a seeded interleaved start order."""
    prompts = system_prompts(config, salt)
    chats = []
    for user in range(config.num_users):
        questions = [f"User {user}, turn {turn}: tell me one fact about {_TOPICS[(user + turn) % len(_TOPICS)]}."
                     for turn in range(config.turns)]
        chats.append(Conversation(user, prompts[user % len(prompts)], questions, user % len(prompts)))
    random.Random(config.seed).shuffle(chats)
    return chats


def parse_counters(metrics_text: str) -> ReplicaCounters:
    """Sum the request and prefix-cache counters over all label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = ReplicaCounters()
    targets = {_REQUESTS_METRIC: "requests", _PREFIX_QUERIES_METRIC: "prefix_queries",
               _PREFIX_HITS_METRIC: "prefix_hits"}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            attribute = targets.get(sample.name.removesuffix("_total"))
            if attribute is not None:
                setattr(counters, attribute, getattr(counters, attribute) + sample.value)
    return counters


async def _read_counters(client, replica: LocalProcess) -> ReplicaCounters | None:
    if not replica.is_alive():
        return None
    try:
        response = await client.get(replica.url + "/metrics", timeout=10)
        response.raise_for_status()
        return parse_counters(response.text)
    except Exception:  # noqa: BLE001 - a dead replica has no counters
        return None


async def _chat(client, url: str, config: RouteBenchConfig, chat: Conversation, gate: asyncio.Semaphore,
                results: list[RequestResult], on_result, sent: list[SentChat], started: float) -> None:
    chat.messages = [{"role": "system", "content": chat.system_prompt}]
    for question in chat.questions:
        chat.messages.append({"role": "user", "content": question})
        body = {"model": config.served_model_name, "messages": chat.messages, "max_tokens": config.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with gate:
            sent.append(SentChat(time.perf_counter() - started, list(chat.messages), chat.tenant))
            result = await stream_one(client, url, body, {})
        results.append(result)
        await on_result()
        # A failed turn keeps the conversation going without its answer, as a retrying client would.
        chat.messages.append({"role": "assistant", "content": result.text if result.ok else ""})


async def run_policy(config: RouteBenchConfig, replicas: list[LocalProcess], policy: str, *,
                     kill_after: int | None = None) -> dict[str, Any]:
    """One gateway with `policy` over the replicas, the whole workload through it."""
    import httpx

    gateway = await asyncio.to_thread(start_gateway, [r.url for r in replicas], policy)
    salt = f"{policy}{'-fault' if kill_after else ''}-{config.seed}"
    killed: list[int] = []
    try:
        limits = httpx.Limits(max_connections=config.concurrency + 4)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.timeout_s, connect=30.0),
                                     trust_env=False) as client:
            before = [await _read_counters(client, r) for r in replicas]
            results: list[RequestResult] = []

            async def on_result() -> None:
                if kill_after is not None and not killed and len(results) >= kill_after:
                    killed.append(len(replicas) - 1)
                    logger.info("killing replica %d after %d requests", killed[0], len(results))
                    await asyncio.to_thread(replicas[-1].kill)

            gate = asyncio.Semaphore(config.concurrency)
            url = gateway.url + "/v1/chat/completions"
            sent: list[SentChat] = []
            started = time.perf_counter()
            await asyncio.gather(*(_chat(client, url, config, chat, gate, results, on_result, sent, started)
                                   for chat in conversations(config, salt)))
            duration_s = time.perf_counter() - started
            after = [await _read_counters(client, r) for r in replicas]
            trace = await trace_of(client, replicas[0].url, config, sent) if config.trace_out else None
    finally:
        await asyncio.to_thread(gateway.stop)
    summary = summarize_policy(policy, results, duration_s, before, after, killed)
    if trace is not None:
        summary["trace_path"] = write_trace(policy_trace_path(config.trace_out, summary["policy"], kill_after),
                                            trace)
    return summary


async def trace_of(client, replica_url: str, config: RouteBenchConfig, sent: list[SentChat]) -> list[TraceRequest]:
    """The run as a trace: each request's prompt tokenized by a replica (after the timed part),
    `prefix_id` its tenant and `prefix_len` the tokens it shares with the tenant's first prompt."""
    first_prompt: dict[int, list[int]] = {}
    trace = []
    for request in sorted(sent, key=lambda r: r.sent_s):
        response = await client.post(replica_url + "/tokenize", json={
            "model": config.served_model_name, "messages": request.messages, "add_generation_prompt": True})
        response.raise_for_status()
        token_ids = response.json()["tokens"]
        first = first_prompt.setdefault(request.tenant, token_ids)
        shared = next((i for i, (a, b) in enumerate(zip(first, token_ids)) if a != b), min(len(first), len(token_ids)))
        trace.append(TraceRequest(request.sent_s, len(token_ids), config.max_tokens, str(request.tenant), shared,
                                  tuple(token_ids)))
    return trace


def policy_trace_path(trace_out: str, policy: str, kill_after: int | None) -> str:
    """`<stem>.<policy>.jsonl` beside `trace_out` (the fault run: `<stem>.<policy>-killed.jsonl`)."""
    from pathlib import Path

    path = Path(trace_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = policy + ("-killed" if kill_after is not None else "")
    return str(path.with_name(f"{path.stem}.{name}{path.suffix or '.jsonl'}"))


def summarize_policy(policy: str, results: list[RequestResult], duration_s: float,
                     before: list[ReplicaCounters | None], after: list[ReplicaCounters | None],
                     killed: list[int]) -> dict[str, Any]:
    """The per-policy figures: hit rates, TTFT, throughput, spread, failures."""
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    deltas = [a.minus(b) if a is not None and b is not None else None for a, b in zip(after, before)]
    live = [d for d in deltas if d is not None]
    engine_queries = sum(d.prefix_queries for d in live)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    ttft = LatencyStats.from_seconds(r.ttft_s for r in ok).as_dict()
    return {
        "policy": policy,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [{"error": e, "count": n} for e, n in sorted(errors.items(), key=lambda kv: -kv[1])[:5]],
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_tokens,
        "prefix_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "engine_prefix_hit_rate": (sum(d.prefix_hits for d in live) / engine_queries
                                   if engine_queries else None),
        "ttft_p50_ms": ttft["p50_ms"],
        "ttft_p99_ms": ttft["p99_ms"],
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else 0.0,
        "requests_per_replica": [None if d is None else int(round(d.requests)) for d in deltas],
        "killed_replicas": killed,
    }


async def _run_all(config: RouteBenchConfig, replicas: list[LocalProcess]) -> list[dict[str, Any]]:
    runs = []
    for policy in config.policies:
        logger.info("routing benchmark: policy %s", policy)
        runs.append(await run_policy(config, replicas, policy))
    if config.kill_replica_after is not None:
        logger.info("routing benchmark: cache_aware with a replica killed mid-run")
        fault = await run_policy(config, replicas, "cache_aware", kill_after=config.kill_replica_after)
        fault["policy"] = "cache_aware + replica killed"
        runs.append(fault)
    return runs


def run(config: RouteBenchConfig) -> dict[str, Any]:
    """Start the replicas, run every policy (and the fault run), stop everything."""
    if not gateway_available():
        from kvserve.bench.replicas import GatewayNotInstalledError
        raise GatewayNotInstalledError("the SGLang Model Gateway is not installed: "
                                       "pip install 'kvserve[router]' (or sglang-router)")
    replicas: list[LocalProcess] = []
    try:
        for index in range(config.num_replicas):
            replicas.append(start_replica(index, config.served_model_name, list(config.replica_flags),
                                          threads=config.replica_threads))
        runs = asyncio.run(_run_all(config, replicas))
    finally:
        for replica in replicas:
            replica.stop()
    summary = {"config": asdict(config), "runs": runs}
    summary["config"]["replica_flags"] = shlex.join(config.replica_flags)
    return summary


def format_result(result: dict[str, Any]) -> str:
    """One row per policy."""
    rows = []
    for run_ in result["runs"]:
        engine_rate = run_["engine_prefix_hit_rate"]
        rows.append([run_["policy"], f"{run_['completed']}/{run_['requests']}", run_["failed"],
                     f"{100 * run_['prefix_hit_rate']:.1f}%",
                     "-" if engine_rate is None else f"{100 * engine_rate:.1f}%",
                     run_["ttft_p50_ms"], run_["ttft_p99_ms"], run_["output_tokens_per_s"],
                     " / ".join("killed" if n is None else str(n) for n in run_["requests_per_replica"])])
    text = format_table(["policy", "ok", "failed", "hit rate", "engine hit rate", "TTFT p50 ms",
                         "TTFT p99 ms", "output tok/s", "requests per replica"], rows,
                        title=f"route: {result['config']['num_replicas']} replicas behind the SGLang gateway")
    for run_ in result["runs"]:
        for entry in run_["errors"]:
            text += f"\n{run_['policy']}: error x{entry['count']}: {entry['error']}"
    return text


def plot(result: dict[str, Any], path) -> str:
    """Hit rate, TTFT and per-replica spread per policy, side by side, as one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [r["policy"].replace(" + ", "\n+ ") for r in runs]
    positions = list(range(len(runs)))
    fig, (ax_hit, ax_ttft, ax_spread) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax_hit.bar(positions, [100 * r["prefix_hit_rate"] for r in runs], color="#4c72b0")
    ax_hit.set_title("prefix-hit rate (cached / prompt tokens)")
    ax_hit.set_ylabel("%")
    width = 0.4
    ax_ttft.bar([p - width / 2 for p in positions], [r["ttft_p50_ms"] for r in runs], width, label="p50")
    ax_ttft.bar([p + width / 2 for p in positions], [r["ttft_p99_ms"] for r in runs], width, label="p99")
    ax_ttft.set_title("time to first token")
    ax_ttft.set_ylabel("ms")
    ax_ttft.legend()
    num_replicas = result["config"]["num_replicas"]
    bottoms = [0.0] * len(runs)
    for index in range(num_replicas):
        counts = [r["requests_per_replica"][index] or 0 for r in runs]
        ax_spread.bar(positions, counts, bottom=bottoms, label=f"replica {index}")
        bottoms = [b + c for b, c in zip(bottoms, counts)]
    ax_spread.set_title("requests served per replica")
    ax_spread.legend(fontsize=8)
    for ax in (ax_hit, ax_ttft, ax_spread):
        ax.set_xticks(positions, names, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
