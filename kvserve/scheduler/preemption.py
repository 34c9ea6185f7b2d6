"""Preemption by recompute: who gives up its blocks when a step runs out of KV."""
from __future__ import annotations

from kvserve.request import Request, RequestStatus


def pick_victim(running: list[Request], policy: str) -> Request:
    """The running request to preempt: the latest admitted (fcfs), or the
    lowest-priority one, latest arrival first among equals (priority)."""
    if policy == "priority":
        return max(running, key=lambda request: (request.priority, request.arrival_time))
    return running[-1]


def reset_for_recompute(request: Request) -> None:
    """Mark a request whose blocks were just given up as preempted: it will be
    recomputed from its tokens (mostly from its own still-cached blocks).

    Output slots still in flight are forgotten: the token of an unprocessed
    step still arrives and is appended, but the recompute starts from the
    tokens known when it is readmitted.
    """
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_output_placeholders = 0
    request.num_preemptions += 1
