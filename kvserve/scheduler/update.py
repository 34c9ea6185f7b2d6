"""Applying one step's `ModelRunnerOutput` to the requests it scheduled."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvserve.request import Request, RequestStatus
from kvserve.messages import (EngineCoreOutput, ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput,
                               TokenLogprobs)
from kvserve.scheduler.stop import check_stop

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvserve.scheduler.scheduler import Scheduler


def apply_sampled_tokens(
    scheduler: "Scheduler",
    scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput,
) -> tuple[list[EngineCoreOutput], dict[str, Request]]:
    """Append each scheduled request's sampled tokens, checking stops token by
    token (tokens after a stop are dropped). Returns the engine outputs and
    the requests that stopped, by id; freeing them is the caller's job.

    Requests finished or aborted while the step was in flight are skipped.
    """
    outputs: list[EngineCoreOutput] = []
    stopped: dict[str, Request] = {}
    requests = scheduler.requests
    max_model_len = scheduler.max_model_len
    index_by_req_id = model_runner_output.req_id_to_index
    sampled_token_ids = model_runner_output.sampled_token_ids
    all_logprobs = model_runner_output.logprobs
    prompt_chunks = model_runner_output.prompt_logprobs or {}
    for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
        request = requests.get(req_id)
        if request is None:
            continue
        request.num_in_flight_tokens -= num_scheduled
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        if drafts and request.last_sched_seq == scheduler_output.step_seq:
            request.spec_token_ids = []  # else they are a later step's, still in flight
        if req_id in prompt_chunks:
            _store_prompt_logprobs(request, prompt_chunks[req_id])
        index = index_by_req_id.get(req_id)
        sampled = sampled_token_ids[index] if index is not None else None
        if not sampled:
            continue  # a prefill chunk that did not reach the last prompt token
        num_drafts, num_accepted = _roll_back_rejected(scheduler, request, drafts, sampled)
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= 1
        was_preempted = request.status == RequestStatus.PREEMPTED
        new_token_ids = _append_until_stop(request, sampled, max_model_len)
        finish_reason = None
        if request.status > RequestStatus.PREEMPTED:
            finish_reason = request.get_finished_reason()
            stopped[req_id] = request
            if was_preempted:
                scheduler.waiting.remove(request)
        elif request.num_in_flight_tokens and not was_preempted:
            # Scheduled ahead: the next allocation would cache these one step late.
            scheduler.cache_processed_blocks(request)
        new_logprobs = None
        if all_logprobs is not None and all_logprobs[index]:
            new_logprobs = all_logprobs[index][:len(new_token_ids)]
        outputs.append(EngineCoreOutput(req_id, new_token_ids, finish_reason, request.stop_reason,
                                        new_logprobs, max(request.num_cached_tokens, 0),
                                        num_drafts, num_accepted, _take_prompt_logprobs(request)))
    return outputs, stopped


def _store_prompt_logprobs(request: Request, chunk: PromptLogprobsChunk) -> None:
    """Keep a step's prompt logprobs by position (a chunk recomputed after a preemption
    overwrites the same positions)."""
    if request.prompt_logprobs is not None:
        start = chunk.first_index - 1
        request.prompt_logprobs[start:start + len(chunk.entries)] = chunk.entries


def _take_prompt_logprobs(request: Request) -> list[TokenLogprobs] | None:
    """The request's prompt logprobs, once: with its first sampled token (every prompt
    position has been computed by then: a request needing them takes no prefix-cache hit)."""
    taken, request.prompt_logprobs = request.prompt_logprobs, None
    if taken is not None and any(entry is None for entry in taken):
        logger.error("request %s: prompt logprobs missing at prompt positions %s", request.request_id,
                     [i + 1 for i, entry in enumerate(taken) if entry is None][:8])
    return taken


def _roll_back_rejected(scheduler: "Scheduler", request: Request, drafts: list[int] | None,
                        sampled: list[int]) -> tuple[int, int]:
    """Settle the drafts the step verified for `request`: its computed tokens count
    the accepted ones now (the rejected ones' slots are rewritten by a later step).
    Returns (drafts, accepted)."""
    if not drafts:
        return 0, 0
    num_accepted = len(sampled) - 1
    if request.status == RequestStatus.RUNNING:  # a preempted one restarts from 0 anyway
        request.num_computed_tokens += num_accepted
    scheduler.speculator.record(request.request_id, len(drafts), num_accepted)
    return len(drafts), num_accepted


def _append_until_stop(request: Request, sampled: list[int], max_model_len: int) -> list[int]:
    if len(sampled) == 1:
        new_token_ids = [sampled[0]]
        request.append_output_token_ids(new_token_ids)
        check_stop(request, max_model_len)
        return new_token_ids
    new_token_ids = []
    for token_id in sampled:
        request.append_output_token_ids(token_id)
        new_token_ids.append(token_id)
        if check_stop(request, max_model_len):
            break
    return new_token_ids
