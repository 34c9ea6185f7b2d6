"""Prometheus metrics of one server app, in a registry of its own.

Metrics vLLM documents carry vLLM's names and labels (`vllm:...`, with
`model_name` and `engine`), so a vLLM Grafana dashboard or autoscaler reads
kvserve unchanged; kvserve's own figures are `kvserve_...` extensions (the
docs/server.md lists both). Engine-wide figures are read at scrape time by a custom
collector from the engine loop's stats and, when the engine has one, its KV
view (blocks per state per group); per-request latencies and token counts are
observed by `RequestTimer` as outputs stream out.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kvserve.engine.async_llm import EngineLoopStats
    from kvserve.engine.kv_view import EngineKVView
    from kvserve.engine.outputs import RequestOutput
    from kvserve.scheduler.speculation import SpecDecodingStats

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _EngineStatsCollector:
    """Reads the engine's stats snapshot (and the latest KV view) on every scrape."""

    def __init__(self, get_stats: Callable[[], "EngineLoopStats"], labels: dict[str, str]) -> None:
        self._get_stats = get_stats
        self._label_names = list(labels)
        self._label_values = list(labels.values())
        self.kv_view: EngineKVView | None = None  # set by the /metrics route just before rendering

    def _family(self, kind: type, name: str, doc: str, value: float):
        family = kind(name, doc, labels=self._label_names)
        family.add_metric(self._label_values, float(value))
        return family

    def collect(self):
        stats = self._get_stats()
        gauges = {
            "vllm:num_requests_running": ("Requests in the engine's running batch", stats.num_running_reqs),
            "vllm:num_requests_waiting": ("Requests waiting to be scheduled (preempted included)",
                                          stats.num_waiting_reqs),
            "vllm:kv_cache_usage_perc": ("Fraction of KV-cache blocks held by requests (1 = full); "
                                         "cached prefixes not counted, see kvserve_kv_cache_blocks",
                                         stats.kv_cache_usage),
            "kvserve_num_requests_in_flight": ("Requests accepted by the server and not finished",
                                               stats.num_in_flight_requests),
            "kvserve_prefix_cache_hit_rate": ("Prefix-cache hits / queries (tokens), since start",
                                              stats.prefix_cache_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield self._family(GaugeMetricFamily, name, doc, value)
        counters = {
            "vllm:num_preemptions": ("Requests preempted by the scheduler", stats.num_preemptions),
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                          stats.prefix_cache_queries),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield self._family(CounterMetricFamily, name, doc, value)
        if stats.spec_decoding is not None:
            yield from self._spec_decode_families(stats.spec_decoding)
        if self.kv_view is not None:
            yield from self._kv_view_families(self.kv_view)

    def _spec_decode_families(self, spec: "SpecDecodingStats"):
        """Speculative decoding under vLLM's names (the exposition adds `_total`)."""
        counters = {
            "vllm:spec_decode_num_drafts": ("Verification steps that carried a draft", spec.num_drafts),
            "vllm:spec_decode_num_draft_tokens": ("Draft tokens proposed", spec.num_draft_tokens),
            "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted", spec.num_accepted_tokens),
        }
        for name, (doc, value) in counters.items():
            yield self._family(CounterMetricFamily, name, doc, value)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose token at this position was accepted",
                                      labels=self._label_names + ["position"])
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric(self._label_values + [str(position)], float(count))
        yield per_pos

    def _kv_view_families(self, view: "EngineKVView"):
        blocks = GaugeMetricFamily("kvserve_kv_cache_blocks",
                                   "KV-cache blocks of the pool by state (in_use, cached = free but holding "
                                   "a prefix, free = empty), seen from each group",
                                   labels=self._label_names + ["group", "kind", "state"])
        own = GaugeMetricFamily("kvserve_kv_cache_group_blocks",
                                "Blocks a group holds in request tables (tables) or has cached (cached)",
                                labels=self._label_names + ["group", "kind", "state"])
        for group in view.kv_cache.groups:
            ids = self._label_values + [str(group.group_id), group.kind]
            for state, value in (("in_use", group.pool.blocks_in_use), ("cached", group.pool.blocks_cached),
                                 ("free", group.pool.blocks_free)):
                blocks.add_metric(ids + [state], float(value))
            own.add_metric(ids + ["tables"], float(group.blocks_in_tables))
            own.add_metric(ids + ["cached"], float(group.blocks_cached_for_group))
        yield blocks
        yield own
        yield self._family(GaugeMetricFamily, "kvserve_num_requests_preempted",
                           "Requests preempted and waiting to be recomputed", view.num_preempted)


class ServerMetrics:
    """All metrics of one app; `render()` gives the Prometheus text format."""

    def __init__(self, get_engine_stats: Callable[[], "EngineLoopStats"], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._label_values = {"model_name": model_name, "engine": "0"}
        self._engine_collector = _EngineStatsCollector(get_engine_stats, self._label_values)
        self.registry.register(self._engine_collector)
        labels = list(self._label_values)
        values = list(self._label_values.values())
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled (counted at the first token)",
                                     labels, registry=self.registry).labels(*values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated",
                                         labels, registry=self.registry).labels(*values)
        self.requests_finished = Counter("vllm:request_success", "Requests finished, by reason",
                                         labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry).labels(*values)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens",
                             labels, buckets=_ITL_BUCKETS_S, registry=self.registry).labels(*values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             labels, buckets=_LATENCY_BUCKETS_S, registry=self.registry).labels(*values)

    def render(self, kv_view: "EngineKVView | None" = None) -> bytes:
        """The exposition text; `kv_view` (an EngineKVView) adds the per-group block gauges."""
        self._engine_collector.kv_view = kv_view
        try:
            return generate_latest(self.registry)
        finally:
            self._engine_collector.kv_view = None

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)

    def count_finish(self, reason: str | None) -> None:
        self.requests_finished.labels(*self._label_values.values(), reason or "abort").inc()


class RequestTimer:
    """Observes one engine request's latencies from the outputs it yields."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._arrival_s = time.perf_counter()
        self._last_token_s: float | None = None
        self._num_tokens = 0
        self._finished = False

    def observe(self, request_output: "RequestOutput") -> None:
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
