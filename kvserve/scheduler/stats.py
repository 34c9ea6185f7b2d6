"""Per-step scheduler statistics for logging and metrics."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.scheduler.speculation import SpecDecodingStats


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler after a step.

    The prefix-cache counters cover the lookups since the previous snapshot;
    `num_preemptions` counts since the scheduler was created.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_deferred_blocks: int
    sched_step_seq: int
    processed_step_seq: int
    # Draft counts since the previous snapshot (None without speculative decoding).
    spec_decoding_stats: "SpecDecodingStats | None" = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


def prefix_cache_counts(prefix_cache_stats: Any) -> tuple[int, int]:
    """(queries, hits) from `KVCacheManager.make_prefix_cache_stats()`."""
    if prefix_cache_stats is None:
        return 0, 0
    return int(prefix_cache_stats.queries), int(prefix_cache_stats.hits)
