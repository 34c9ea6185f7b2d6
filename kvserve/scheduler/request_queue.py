"""Waiting-request queues: first come first served, or by priority."""
from __future__ import annotations

import heapq
from collections import deque
from typing import Iterator

from kvserve.request import Request


class RequestQueue:
    """The waiting queue the scheduler admits from, head first."""

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def prepend(self, request: Request) -> None:
        """Put back a request that should go before the others of its rank
        (a preempted one, or one skipped in this step)."""
        raise NotImplementedError

    def peek(self) -> Request:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest `priority` value first, then earliest arrival, then request id.

    A heap has no front, so `prepend` is a push: a preempted request keeps
    its rank, which puts it ahead of everything that arrived after it.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time,
                                    request.request_id, request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The queue for a `SchedulerConfig.policy` ("fcfs" or "priority")."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
