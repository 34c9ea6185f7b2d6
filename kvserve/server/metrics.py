"""Prometheus metrics of one server app, in a registry of its own.

Engine-wide figures (running/waiting requests, KV usage, prefix-cache hit
rate, preemptions) are read from the engine loop's stats snapshot at scrape
time by a custom collector; per-request latencies and token counts are
observed by `RequestTimer` as outputs stream out.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineStatsCollector:
    """Reads the engine's stats snapshot on every scrape."""

    def __init__(self, get_stats: Callable[[], Any]) -> None:
        self._get_stats = get_stats

    def collect(self):
        stats = self._get_stats()
        gauges = {
            "kvserve_num_requests_running": ("Requests in the engine's running batch", stats.num_running_reqs),
            "kvserve_num_requests_waiting": ("Requests waiting to be scheduled", stats.num_waiting_reqs),
            "kvserve_num_requests_in_flight": ("Requests accepted by the server and not finished",
                                               stats.num_in_flight_requests),
            "kvserve_kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (1 = full)", stats.kv_cache_usage),
            "kvserve_prefix_cache_hit_rate": ("Prefix-cache hits / queries (tokens), since start",
                                              stats.prefix_cache_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "kvserve_num_preemptions": ("Requests preempted by the scheduler", stats.num_preemptions),
            "kvserve_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                             stats.prefix_cache_queries),
            "kvserve_prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))
        if getattr(stats, "spec_decoding", None) is not None:
            yield from _spec_decode_counters(stats.spec_decoding)


def _spec_decode_counters(spec: Any):
    """Speculative decoding under vLLM's metric names (`_total` is added by the exposition)."""
    counters = {
        "vllm:spec_decode_num_drafts": ("Verification steps that carried a draft", spec.num_drafts),
        "vllm:spec_decode_num_draft_tokens": ("Draft tokens proposed", spec.num_draft_tokens),
        "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted", spec.num_accepted_tokens),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=float(value))
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafts whose token at this position was accepted", labels=["position"])
    for position, count in enumerate(spec.num_accepted_tokens_per_pos):
        per_pos.add_metric([str(position)], float(count))
    yield per_pos


class ServerMetrics:
    """All metrics of one app; `render()` gives the Prometheus text format."""

    def __init__(self, get_engine_stats: Callable[[], Any], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(get_engine_stats))
        labels = ["model_name"]
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens prefilled (counted at the first token)",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("kvserve_generation_tokens", "Tokens generated",
                                         labels, registry=self.registry).labels(model_name)
        self.requests_finished = Counter("kvserve_request_success", "Requests finished, by reason",
                                         labels + ["finished_reason"], registry=self.registry)
        self._model_name = model_name
        self.ttft = Histogram("kvserve_time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry).labels(model_name)
        self.itl = Histogram("kvserve_inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=_ITL_BUCKETS_S, registry=self.registry).labels(model_name)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds", "Request latency, arrival to finish",
                             labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)

    def count_finish(self, reason: str | None) -> None:
        self.requests_finished.labels(self._model_name, reason or "abort").inc()


class RequestTimer:
    """Observes one engine request's latencies from the outputs it yields."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._arrival_s = time.perf_counter()
        self._last_token_s: float | None = None
        self._num_tokens = 0
        self._finished = False

    def observe(self, request_output: Any) -> None:
        now = time.perf_counter()
        num_tokens = sum(len(c.token_ids) for c in request_output.outputs)
        new_tokens = num_tokens - self._num_tokens
        if new_tokens > 0:
            if self._last_token_s is None:
                self._metrics.ttft.observe(now - self._arrival_s)
                self._metrics.prompt_tokens.inc(len(request_output.prompt_token_ids or []))
            else:
                gap_s = (now - self._last_token_s) / new_tokens
                for _ in range(new_tokens):
                    self._metrics.itl.observe(gap_s)
            self._last_token_s = now
            self._metrics.generation_tokens.inc(new_tokens)
            self._num_tokens = num_tokens
        if request_output.finished:
            self._finished = True
            self._metrics.e2e.observe(now - self._arrival_s)
            for completion in request_output.outputs:
                self._metrics.count_finish(completion.finish_reason)

    def close(self) -> None:
        """The stream ended; one that never finished was aborted (e.g. a disconnect)."""
        if not self._finished:
            self._finished = True
            self._metrics.count_finish("abort")
