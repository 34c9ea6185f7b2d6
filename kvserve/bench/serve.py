"""Serving benchmark: a streaming client for any OpenAI-compatible server on loopback.

Requests go out at a fixed concurrency, or as a Poisson process at a given
rate (optionally also capped in concurrency). Each response is streamed
(SSE) and timed per chunk:

- TTFT: request sent -> first chunk carrying generated text.
- ITL: gaps between successive text-carrying chunks.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request.
- E2E: request sent -> stream finished.

Output tokens come from the stream's `usage` when the server sends it, else
one per text-carrying chunk.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvserve.bench.report import LatencyStats, format_table
from kvserve.bench.workloads import text_prompts

logger = logging.getLogger(__name__)


class NotLoopbackError(ValueError):
    """The target URL is not on this machine; the serving benchmark only drives local servers."""


@dataclass
class ServeBenchConfig:
    """What to send and how fast. `request_rate` None sends as fast as `concurrency` allows."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    num_prompts: int = 64
    prompt_words: int = 128
    max_tokens: int = 128
    concurrency: int | None = 8
    request_rate: float | None = None
    ignore_eos: bool = True
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0
    trace_out: str | None = None  # write the run as a `kvserve plan --trace` JSONL

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be > 0 requests/s, got {self.request_rate}")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give a concurrency, a request rate, or both")
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("num_prompts and max_tokens must be >= 1")
        check_loopback(self.base_url)


@dataclass
class RequestResult:
    """Timings of one streamed request; `error` set when it failed."""

    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""
    sent_s: float = 0.0  # when it was sent, seconds from the start of the run

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def check_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname
    if host is None:
        raise NotLoopbackError(f"cannot read a host from URL {base_url!r}")
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise NotLoopbackError(f"the serving benchmark only targets servers on loopback (127.0.0.1, ::1, "
                           f"localhost); got host {host!r}")


def _api_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def _request_body(config: ServeBenchConfig, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text_parts = []
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text_parts.append(choice.get("text") or "")
        else:
            text_parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text_parts)


async def stream_one(client, url: str, body: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    """Send one streaming request and time it; failures come back as `ok=False`, never raised."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    text_parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:200]
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(ok=False, error=f"stream error: {json.dumps(chunk['error'])[:200]}")
                chunk_text = _chunk_text(chunk)
                if chunk_text:
                    arrivals.append(time.perf_counter())
                    text_parts.append(chunk_text)
                usage = chunk.get("usage") or usage
    except Exception as exc:  # a benchmark counts failures instead of stopping at the first
        return RequestResult(ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
    finished = time.perf_counter()
    if not arrivals:
        return RequestResult(ok=False, error="stream ended without generated text")
    output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(arrivals)
    return RequestResult(
        ok=True,
        prompt_tokens=int(usage.get("prompt_tokens", 0)) if usage else 0,
        cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0) if usage else 0,
        output_tokens=output_tokens,
        ttft_s=arrivals[0] - sent,
        e2e_s=finished - sent,
        itl_s=[b - a for a, b in zip(arrivals, arrivals[1:])],
        text="".join(text_parts),
    )


async def _discover_model(client, api_root: str, headers: dict[str, str]) -> str:
    response = await client.get(f"{api_root}/models", headers=headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{api_root}/models lists no model; pass --served-model")
    return models[0]["id"]


async def run_async(config: ServeBenchConfig) -> dict[str, Any]:
    """Send the whole workload and return the summary dict (see `summarize`)."""
    import httpx

    api_root = _api_root(config.base_url)
    url = f"{api_root}/{'chat/completions' if config.endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    prompts = text_prompts(config.num_prompts, config.prompt_words, seed=config.seed)
    max_open = config.concurrency or config.num_prompts
    limits = httpx.Limits(max_connections=max_open, max_keepalive_connections=max_open)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = config.model or await _discover_model(client, api_root, headers)
        gate = asyncio.Semaphore(config.concurrency) if config.concurrency else None
        arrival_rng = random.Random(config.seed + 1)

        async def one(prompt: str) -> RequestResult:
            body = _request_body(config, model, prompt)
            if gate is None:
                return await _timed(stream_one(client, url, body, headers))
            async with gate:
                return await _timed(stream_one(client, url, body, headers))

        async def _timed(request) -> RequestResult:
            sent_s = time.perf_counter() - started
            result = await request
            result.sent_s = sent_s
            return result

        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            if config.request_rate is not None and tasks:
                await asyncio.sleep(arrival_rng.expovariate(config.request_rate))
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - started
    summary = summarize(results, duration_s)
    if config.trace_out:
        summary["trace_path"] = write_run_trace(config.trace_out, results)
    summary["config"] = {k: v for k, v in asdict(config).items() if k != "api_key"}
    summary["config"]["model"] = model
    return summary


def write_run_trace(path: str, results: list[RequestResult]) -> str:
    """The completed requests as a trace: send time, prompt and output tokens (no shared prefix:
    the prompts are independent)."""
    from kvserve.planner.trace import TraceRequest, write_trace

    done = sorted((r for r in results if r.ok and r.prompt_tokens and r.output_tokens), key=lambda r: r.sent_s)
    return write_trace(path, [TraceRequest(r.sent_s, r.prompt_tokens, r.output_tokens) for r in done])


def run(config: ServeBenchConfig) -> dict[str, Any]:
    """Synchronous entry point (one event loop for the whole benchmark)."""
    return asyncio.run(run_async(config))


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles over the successful requests; errors counted by message."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    errors = Counter(r.error for r in results if not r.ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": [{"error": message, "count": count} for message, count in errors.most_common(5)],
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s if duration_s > 0 else 0.0,
        "ttft": LatencyStats.from_seconds(r.ttft_s for r in ok).as_dict(),
        "tpot": LatencyStats.from_seconds(r.tpot_s for r in ok if r.tpot_s is not None).as_dict(),
        "itl": LatencyStats.from_seconds(gap for r in ok for gap in r.itl_s).as_dict(),
        "e2e": LatencyStats.from_seconds(r.e2e_s for r in ok).as_dict(),
    }


def format_result(result: dict[str, Any]) -> str:
    """The table a person reads after a serving run."""
    head = format_table(
        ["requests ok", "failed", "duration s", "req/s", "output tok/s", "total tok/s"],
        [[result["completed"], result["failed"], result["duration_s"], result["request_throughput"],
          result["output_token_throughput"], result["total_token_throughput"]]],
        title="serve: throughput")
    latency = format_table(
        ["metric", "mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms"],
        [[name.upper(), s["mean_ms"], s["p50_ms"], s["p90_ms"], s["p99_ms"], s["max_ms"]]
         for name, s in ((n, result[n]) for n in ("ttft", "tpot", "itl", "e2e"))],
        title="serve: latency")
    text = head + "\n\n" + latency
    for entry in result["errors"]:
        text += f"\nerror x{entry['count']}: {entry['error']}"
    return text
