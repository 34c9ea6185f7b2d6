"""What one `schedule()` call decided, and the `SchedulerOutput` built from it.

Request counters are not touched while a step is being planned, so a
request can be taken out of the plan again (a priority victim preempted
after it was scheduled) by refunding its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.request import Request
from kvserve.messages import CachedRequestData, NewRequestData, SchedulerOutput

BlockIdsByGroup = tuple[list[int], ...]


@dataclass
class StepPlan:
    """Requests scheduled in this step, in scheduling order, with their token counts."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    running_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, BlockIdsByGroup | None] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_proposal_req_ids: set[str] = field(default_factory=set)
    after_unverified_drafts_req_ids: set[str] = field(default_factory=set)

    def add_running(self, request: Request, num_tokens: int, new_block_ids: BlockIdsByGroup | None,
                    draft_token_ids: list[int] | None = None) -> None:
        """`num_tokens` counts the draft tokens to verify, if any."""
        self.running_reqs.append(request)
        self.new_block_ids[request.request_id] = new_block_ids
        if draft_token_ids:
            self.spec_token_ids[request.request_id] = draft_token_ids
        self._take_budget(request, num_tokens)

    def add_admitted(self, request: Request, num_tokens: int, resumed: bool) -> None:
        (self.resumed_reqs if resumed else self.new_reqs).append(request)
        self._take_budget(request, num_tokens)

    def remove(self, request: Request) -> None:
        """Drop a request scheduled earlier in this step and refund its tokens."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, None)
        if num_tokens is None:
            return
        self.token_budget += num_tokens
        self.new_block_ids.pop(request.request_id, None)
        self.spec_token_ids.pop(request.request_id, None)
        self.draft_proposal_req_ids.discard(request.request_id)
        self.after_unverified_drafts_req_ids.discard(request.request_id)
        for reqs in (self.running_reqs, self.new_reqs, self.resumed_reqs):
            if request in reqs:
                reqs.remove(request)

    def scheduled_requests(self) -> list[Request]:
        return self.running_reqs + self.resumed_reqs + self.new_reqs

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def _take_budget(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens


def build_scheduler_output(
    plan: StepPlan,
    step_seq: int,
    get_block_ids: Callable[[str], BlockIdsByGroup],
    finished_req_ids: set[str],
    block_copies: list[KVCacheBlockCopy],
) -> SchedulerOutput:
    """The message for the runner: admitted requests in full (resumed ones with
    their outputs so far), running ones as block-table deltas."""
    new_reqs_data = [
        _new_request_data(request, get_block_ids(request.request_id), with_outputs=False)
        for request in plan.new_reqs
    ] + [
        _new_request_data(request, get_block_ids(request.request_id), with_outputs=True)
        for request in plan.resumed_reqs
    ]
    cached = CachedRequestData(
        req_ids=[request.request_id for request in plan.running_reqs],
        new_block_ids=[plan.new_block_ids[request.request_id] for request in plan.running_reqs],
        num_computed_tokens=[request.num_computed_tokens for request in plan.running_reqs],
    )
    return SchedulerOutput(
        step_seq=step_seq,
        scheduled_new_reqs=new_reqs_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(plan.num_scheduled_tokens),
        total_num_scheduled_tokens=plan.total_num_scheduled_tokens,
        finished_req_ids=finished_req_ids,
        preempted_req_ids=set(plan.preempted_req_ids),
        kv_cache_block_copies=block_copies,
        scheduled_spec_decode_tokens={req_id: list(drafts) for req_id, drafts in plan.spec_token_ids.items()},
        draft_proposal_req_ids=set(plan.draft_proposal_req_ids),
        after_unverified_drafts_req_ids=set(plan.after_unverified_drafts_req_ids),
    )


def _new_request_data(request: Request, block_ids: BlockIdsByGroup, with_outputs: bool) -> NewRequestData:
    return NewRequestData(
        req_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),  # a copy: the message is a value
        sampling_params=request.sampling_params,
        block_ids=block_ids,
        num_computed_tokens=request.num_computed_tokens,
        output_token_ids=list(request.output_token_ids) if with_outputs else [],
    )


def block_ids_or_none(blocks: Any) -> BlockIdsByGroup | None:
    """Per-group ids of newly allocated `KVCacheBlocks`, or None when there are none."""
    if not any(blocks.blocks):
        return None
    return blocks.get_block_ids()
