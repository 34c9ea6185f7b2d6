"""What the engine shows of its KV cache and queues: `EngineKVView`.

Built on the engine thread (which owns the scheduler) from the block pool,
the scheduler's queues and a short timeline of recent steps. Holds request
ids and counts, never prompt or output text.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.kv_cache.snapshot import KVCacheSnapshot, snapshot_kv_cache
from kvserve.request import Request, RequestStatus

STEP_TIMELINE_LEN = 120
MAX_LISTED_REQUESTS = 64
_MAX_UNFINISHED_STEPS = 16


@dataclass(frozen=True)
class StepRecord:
    """One applied engine step."""

    step_seq: int
    num_tokens: int
    num_requests: int
    duration_ms: float
    finished_at_s: float  # time.time() when its output was applied


@dataclass(frozen=True)
class RequestKVState:
    """One live request's place in the queues and its KV footprint."""

    request_id: str
    status: str
    num_blocks: int
    num_computed_tokens: int
    num_tokens: int
    num_preemptions: int


@dataclass(frozen=True)
class PrefixCacheTotals:
    """Prompt tokens looked up in / found in the prefix cache since start."""

    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True)
class EngineKVView:
    """The KV cache, the request queues and recent steps at one instant."""

    taken_at_s: float
    kv_cache: KVCacheSnapshot
    prefix_cache: PrefixCacheTotals
    num_running: int
    num_waiting: int
    num_preempted: int
    num_preemptions: int
    requests: list[RequestKVState] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)


class StepTimeline:
    """The last `max_len` steps: when each was scheduled and what it ran."""

    def __init__(self, max_len: int = STEP_TIMELINE_LEN) -> None:
        self._records: deque[StepRecord] = deque(maxlen=max_len)
        self._started_s: dict[int, float] = {}
        self._last_finished_s = 0.0

    def start(self, step_seq: int) -> None:
        self._started_s[step_seq] = time.perf_counter()
        if len(self._started_s) > _MAX_UNFINISHED_STEPS:  # failed steps never finish
            del self._started_s[min(self._started_s)]

    def finish(self, step_seq: int, num_tokens: int, num_requests: int) -> None:
        """Record a step whose output was just applied.

        With a step scheduled ahead its start is counted from the previous
        step's end, so durations are the engine's step period, not overlapped.
        """
        now = time.perf_counter()
        started = max(self._started_s.pop(step_seq, now), self._last_finished_s)
        self._last_finished_s = now
        if num_tokens:
            self._records.append(StepRecord(step_seq, num_tokens, num_requests,
                                            (now - started) * 1e3, time.time()))

    def records(self) -> list[StepRecord]:
        return list(self._records)


def _request_state(request: Request, manager) -> RequestKVState:
    num_blocks = sum(1 for blocks in manager.coordinator.get_blocks(request.request_id)
                     for block in blocks if not block.is_null)
    return RequestKVState(request.request_id, request.status.name.lower(), num_blocks,
                          request.num_computed_tokens, request.num_tokens, request.num_preemptions)


def build_kv_view(scheduler, timeline: StepTimeline, prefix_cache: PrefixCacheTotals,
                  max_listed_requests: int = MAX_LISTED_REQUESTS) -> EngineKVView:
    """An `EngineKVView` of `scheduler`; call it from the thread that owns it."""
    manager = scheduler.kv_cache_manager
    waiting = list(scheduler.waiting)
    num_preempted = sum(1 for r in waiting if r.status == RequestStatus.PREEMPTED)
    listed = (list(scheduler.running) + waiting)[:max_listed_requests]
    return EngineKVView(
        taken_at_s=time.time(), kv_cache=snapshot_kv_cache(manager), prefix_cache=prefix_cache,
        num_running=len(scheduler.running), num_waiting=len(waiting) - num_preempted,
        num_preempted=num_preempted, num_preemptions=scheduler.num_preemptions,
        requests=[_request_state(r, manager) for r in listed], steps=timeline.records())
