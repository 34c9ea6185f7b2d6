"""Fenced block frees for async scheduling.

With async scheduling the engine may schedule step N+1 before it has
processed the output of step N. A block that step N still reads or writes
must not go back to the free queue (where `get_new_blocks` could hand it to
another request) until step N is processed. Each non-empty step gets a
sequence number; a list of blocks given up while a step that referenced them
is unprocessed is parked with that step's number (its *fence*) and returned
to the pool once `processed_step_seq` reaches the fence.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Protocol


class _FreesBlocks(Protocol):
    def free_blocks(self, ordered_blocks: Any) -> None: ...


def free_or_defer(
    block_pool: _FreesBlocks,
    deferred_frees: deque[tuple[int, list[Any]]],
    blocks: list[Any],
    fence_seq: int,
    processed_step_seq: int,
    defer_block_free: bool,
) -> None:
    """Free `blocks` now if their fence is met (or deferral is off), else park
    them as-is behind `fence_seq`. Either way they reach `free_blocks` in the
    order given."""
    if not defer_block_free or fence_seq <= processed_step_seq:
        block_pool.free_blocks(blocks)
        return
    if blocks:
        deferred_frees.append((fence_seq, blocks))


def drain_ready(
    block_pool: _FreesBlocks,
    deferred_frees: deque[tuple[int, list[Any]]],
    processed_step_seq: int,
) -> int:
    """Free, oldest first and each list as-is, every parked list whose fence is
    processed; stop at the first unmet fence. Returns the number of blocks freed."""
    num_freed = 0
    while deferred_frees and deferred_frees[0][0] <= processed_step_seq:
        _, blocks = deferred_frees.popleft()
        block_pool.free_blocks(blocks)
        num_freed += len(blocks)
    return num_freed


class DeferredBlockFrees:
    """Step sequence numbers and the queue of block lists waiting on a fence: the
    scheduler's fence state (`Scheduler` keeps it in these fields, under the names the
    seed's contract fixes: `defer_block_free`, `deferred_frees`, `sched_step_seq`,
    `processed_step_seq`).

    Ordering rule: a parked list is freed **as-is**, in one `free_blocks`
    call, exactly as the immediate path would have freed it. Callers park
    lists already in eviction order (`KVCacheManager.pop_blocks_for_free`:
    each KV-cache group's blocks tail first, groups concatenated; CoW
    retentions `[src, dst, ...]`, group 0 first), so deferring a free never
    changes which blocks return to the pool or in what order, only when.
    The queue drains oldest first and stops at the first unmet fence.

    Invariant: `0 <= processed_step_seq <= sched_step_seq`; neither moves on
    an empty step.
    """

    def __init__(self, defer_block_free: bool) -> None:
        self.defer_block_free = defer_block_free
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list[Any]]] = deque()

    def next_step_seq(self) -> int:
        """The sequence number the step being scheduled gets if it is non-empty."""
        return self.sched_step_seq + 1

    def mark_scheduled(self) -> int:
        self.sched_step_seq += 1
        return self.sched_step_seq

    def mark_processed(self, step_seq: int) -> None:
        """Record that the output of step `step_seq` has been applied."""
        if step_seq != self.processed_step_seq + 1 or step_seq > self.sched_step_seq:
            raise RuntimeError(
                f"step outputs must be applied in order: got step {step_seq}, "
                f"expected {self.processed_step_seq + 1} (scheduled up to {self.sched_step_seq})")
        self.processed_step_seq = step_seq

    def is_fenced(self, last_sched_seq: int) -> bool:
        """Whether blocks last referenced by step `last_sched_seq` must wait."""
        return self.defer_block_free and last_sched_seq > self.processed_step_seq

    def free_or_defer_blocks(self, block_pool: _FreesBlocks, blocks: list[Any], fence_seq: int) -> None:
        free_or_defer(block_pool, self.deferred_frees, blocks, fence_seq,
                      self.processed_step_seq, self.defer_block_free)

    def drain_ready_blocks(self, block_pool: _FreesBlocks) -> int:
        return drain_ready(block_pool, self.deferred_frees, self.processed_step_seq)

    @property
    def num_deferred_blocks(self) -> int:
        return sum(len(blocks) for _, blocks in self.deferred_frees)
