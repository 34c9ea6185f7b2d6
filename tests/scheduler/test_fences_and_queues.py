"""The fence bookkeeping and the waiting queues, tested directly."""
import pytest

from kvserve.request import Request
from kvserve.scheduler.deferred_free import DeferredBlockFrees
from kvserve.scheduler.request_queue import create_request_queue


class RecordingPool:
    def __init__(self):
        self.calls = []

    def free_blocks(self, ordered_blocks):
        self.calls.append(list(ordered_blocks))


def test_fences_free_as_is_oldest_first_and_stop_at_the_first_unmet_fence():
    fences, pool = DeferredBlockFrees(defer_block_free=True), RecordingPool()
    for _ in range(3):
        fences.mark_scheduled()
    fences.free_or_defer_blocks(pool, ["a2", "a1"], fence_seq=2)
    fences.free_or_defer_blocks(pool, ["b3", "b2", "b1"], fence_seq=3)
    fences.free_or_defer_blocks(pool, ["c"], fence_seq=1)  # met, but queued behind an unmet fence
    assert pool.calls == [] and fences.num_deferred_blocks == 6
    fences.mark_processed(1)
    assert fences.drain_ready_blocks(pool) == 0  # the head (fence 2) is unmet: nothing passes it
    fences.mark_processed(2)
    assert fences.drain_ready_blocks(pool) == 2
    assert pool.calls == [["a2", "a1"]]
    fences.mark_processed(3)
    assert fences.drain_ready_blocks(pool) == 4
    assert pool.calls == [["a2", "a1"], ["b3", "b2", "b1"], ["c"]]
    assert not fences.deferred_frees


def test_fences_frees_at_once_when_met_or_disabled_and_skips_empty_lists():
    fences, pool = DeferredBlockFrees(defer_block_free=True), RecordingPool()
    fences.mark_scheduled()
    fences.mark_processed(1)
    fences.free_or_defer_blocks(pool, ["x"], fence_seq=1)
    fences.free_or_defer_blocks(pool, [], fence_seq=5)
    assert pool.calls == [["x"]] and not fences.deferred_frees
    assert not fences.is_fenced(1) and fences.is_fenced(2)
    fences.defer_block_free = False
    fences.free_or_defer_blocks(pool, ["y"], fence_seq=9)
    assert pool.calls[-1] == ["y"] and not fences.is_fenced(9)


def test_outputs_must_be_applied_in_step_order():
    fences = DeferredBlockFrees(defer_block_free=True)
    fences.mark_scheduled()
    fences.mark_scheduled()
    with pytest.raises(RuntimeError):
        fences.mark_processed(2)
    fences.mark_processed(1)
    with pytest.raises(RuntimeError):
        fences.mark_processed(1)
    fences.mark_processed(2)
    with pytest.raises(RuntimeError):
        fences.mark_processed(3)  # never scheduled


def _request(request_id, priority=0, arrival_time=0.0):
    return Request(request_id, [1, 2, 3], priority=priority, arrival_time=arrival_time)


def test_fcfs_queue_keeps_arrival_order_and_prepends_preempted():
    queue = create_request_queue("fcfs")
    a, b, c = _request("a"), _request("b"), _request("c")
    for request in (a, b):
        queue.add(request)
    queue.prepend(c)
    assert list(queue) == [c, a, b] and queue.peek() is c
    queue.remove(a)
    assert [queue.pop(), queue.pop()] == [c, b] and not queue


def test_priority_queue_orders_by_priority_then_arrival_then_id():
    queue = create_request_queue("priority")
    late_urgent = _request("x", priority=0, arrival_time=5.0)
    early_urgent = _request("y", priority=0, arrival_time=1.0)
    tie = _request("w", priority=0, arrival_time=1.0)
    relaxed = _request("z", priority=3, arrival_time=0.0)
    for request in (relaxed, late_urgent, early_urgent, tie):
        queue.add(request)
    assert list(queue) == [tie, early_urgent, late_urgent, relaxed]
    queue.remove(early_urgent)
    queue.prepend(early_urgent)  # a preempted request keeps its rank
    assert [queue.pop() for _ in range(4)] == [tie, early_urgent, late_urgent, relaxed]
    with pytest.raises(ValueError):
        create_request_queue("lifo")
