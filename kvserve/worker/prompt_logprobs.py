"""Prompt logprobs (`SamplingParams.prompt_logprobs`): which of a step's tokens score a
prompt token, and the logprobs of those prompt tokens.

The logits at prompt position p score prompt token p + 1, so a prefill chunk over
positions [start, end) scores prompt tokens start + 1 .. min(end, n - 1) of an n-token
prompt. Only steps holding such a request compute these extra logits rows; a request
that has sampled a token already (a resumed one) has emitted its prompt logprobs and
scores nothing again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.messages import PromptLogprobsChunk
from kvserve.sample.sampler import gather_logprobs

# Rows put through log_softmax at once: bounds the extra float32 memory to
# this many vocabulary-sized rows.
LOG_SOFTMAX_ROWS = 512


@dataclass
class PromptLogprobsPlan:
    """The step's prompt-scoring rows: request i scores `counts[i]` prompt tokens from
    index `first_index[i]` with its top `num_logprobs[i]`; `rows` holds the flat token
    slots whose logits do it (request after request), `target_token_ids` the prompt
    tokens they score."""

    req_ids: list[str]
    first_index: list[int]
    counts: list[int]
    num_logprobs: list[int]
    rows: np.ndarray
    target_token_ids: list[int]


def plan_prompt_logprobs(prepared, states) -> PromptLogprobsPlan | None:
    """The plan of a `PreparedBatch` given the runner's `RequestState`s, or None when no
    request of the step scores a prompt token (the usual case: nothing extra is done)."""
    plan = None
    for i, req_id in enumerate(prepared.req_ids):
        state = states[req_id]
        num_logprobs = state.sampling_params.prompt_logprobs
        if num_logprobs is None or state.output_token_ids:
            continue
        start = int(prepared.num_computed_tokens[i])
        end = min(start + int(prepared.num_scheduled_tokens[i]), len(state.prompt_token_ids) - 1)
        if end <= start:
            continue
        if plan is None:
            plan = PromptLogprobsPlan([], [], [], [], np.zeros(0, dtype=np.int64), [])
        first_slot = int(prepared.query_start_loc[i])
        plan.req_ids.append(req_id)
        plan.first_index.append(start + 1)
        plan.counts.append(end - start)
        plan.num_logprobs.append(num_logprobs)
        plan.rows = np.concatenate([plan.rows, np.arange(first_slot, first_slot + end - start, dtype=np.int64)])
        plan.target_token_ids.extend(state.prompt_token_ids[start + 1:end + 1])
    return plan


def gather_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobsPlan) -> dict[str, PromptLogprobsChunk]:
    """Each planned request's chunk, from the float32 logits of `plan.rows` (in that order)."""
    per_row_k = np.repeat(plan.num_logprobs, plan.counts).tolist()
    entries = []
    for begin in range(0, len(plan.target_token_ids), LOG_SOFTMAX_ROWS):
        end = begin + LOG_SOFTMAX_ROWS
        logprobs = torch.log_softmax(logits[begin:end].float(), dim=-1)
        entries.extend(gather_logprobs(logprobs, plan.target_token_ids[begin:end], per_row_k[begin:end]))
    chunks, offset = {}, 0
    for req_id, first_index, count in zip(plan.req_ids, plan.first_index, plan.counts):
        chunks[req_id] = PromptLogprobsChunk(first_index, entries[offset:offset + count])
        offset += count
    return chunks
