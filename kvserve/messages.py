"""Messages that cross layers: scheduler -> model runner -> scheduler -> engine.

SchedulerOutput is a diff: new requests come in full, running ones as deltas.
The runner keeps per-request state between steps and never sees a Request.
Torch-free and below both the model and the scheduler, so neither imports the
other. Every message is a frozen, slotted dataclass: a value, built once by its
sender (NewRequestData copies the prompt ids rather than sharing the live list).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv_cache.utils import KVCacheBlockCopy
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption
    (then `output_token_ids` holds the outputs so far and the runner replaces
    any state it had). `block_ids[g]` is the whole block table of group g."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Running requests scheduled again, as parallel lists.

    `new_block_ids[i]` holds, per group, the block ids appended to request i's
    table since it was last scheduled (None when none were); for a sliding
    window group, positions released since then are reported in
    `num_computed_tokens` only (the runner never reads them again).
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's plan: which requests run how many tokens, on which blocks.

    `num_computed_tokens` of each request (in new or cached data) is the
    position of its first scheduled token. Under async scheduling a cached
    request may be scheduled for a decode whose input token is the output of
    the previous, still unprocessed step: the runner feeds it the token it
    sampled there. `kv_cache_block_copies` must be applied before the forward
    pass; `finished_req_ids` lists requests whose runner state can be dropped.
    `scheduled_spec_decode_tokens[r]` are draft tokens to verify after request
    r's last known token; they are counted in its `num_scheduled_tokens`, and
    the runner returns 1 to 1 + len(drafts) tokens for it.
    `draft_proposal_req_ids` (speculation with a draft model): requests whose
    step samples and whose slots have room for the draft model to propose
    `num_speculative_tokens` tokens after it. Their next step's drafts arrive as
    placeholders (-1) that the runner replaces with that proposal. Requests in
    `after_unverified_drafts_req_ids` were scheduled while their previous step,
    which verifies drafts, was in flight: their `num_computed_tokens` counts
    none of those drafts, and the runner starts them after their last sampled
    token instead.
    """

    step_seq: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_cache_block_copies: list[KVCacheBlockCopy] = field(default_factory=list)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    draft_proposal_req_ids: set[str] = field(default_factory=set)
    after_unverified_drafts_req_ids: set[str] = field(default_factory=set)

    @classmethod
    def make_empty(cls, step_seq: int = 0) -> "SchedulerOutput":
        return cls(step_seq, [], CachedRequestData(), {}, 0)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one sampled position: the sampled token's and the top N."""

    sampled_token_id: int
    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs one step computed for one request: `entries[i]` scores prompt
    token `first_index + i` (its `sampled_token_id`) given the tokens before it."""

    first_index: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Tokens sampled in one step. `sampled_token_ids[i]` is empty for a request
    whose prefill chunk did not reach its last prompt token. `logprobs[i]`
    (when requested) has one entry per sampled token of request i;
    `prompt_logprobs[req_id]` the prompt positions this step scored for a request
    that asked for them (`SamplingParams.prompt_logprobs`)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    logprobs: list[list[TokenLogprobs]] | None = None
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None

    def __post_init__(self) -> None:
        if not self.req_id_to_index:
            object.__setattr__(self, "req_id_to_index", {rid: i for i, rid in enumerate(self.req_ids)})

    @classmethod
    def make_empty(cls) -> "ModelRunnerOutput":
        return cls([], [])


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step did for one request, for the engine front-end.

    `finish_reason` is "stop", "length" or "abort" once the request finished;
    `stop_reason` the stop token id that ended it, if any. `prompt_logprobs`
    (on the output that carries the first sampled token of a request that asked
    for them) scores prompt tokens 1 .. n-1, one entry each. With speculative
    decoding, `num_draft_tokens` drafts were verified in this step and
    `num_accepted_tokens` of them accepted.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
