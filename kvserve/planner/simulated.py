"""The simulated model runner the planner drives: the real scheduler over a synthetic
KV-cache layout (`create_scheduler`), requests with ids "0", "1", ... (`create_requests`)
and `FakeModelRunner`, which turns a `SchedulerOutput` into a `ModelRunnerOutput` with
deterministic tokens, keeping per-request state the way a real runner does. Imports no
torch; `kvserve.testing` re-exports all three for the tests.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.messages import ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput, TokenLogprobs
from kvserve.scheduler.scheduler import Scheduler


def create_scheduler(
    *,
    num_blocks: int = 10_000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    kv_cache_specs: Sequence[KVCacheSpec] | None = None,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    hash_block_size: int | None = None,
    defer_block_free: bool | None = None,
    speculative_config=None,
    num_state_blocks: int = 0,
) -> Scheduler:
    """A scheduler over `num_blocks` blocks (block 0 is the null block), one
    KV-cache group per spec in `kv_cache_specs` (default: one full-attention
    group); `num_state_blocks` > 0 gives the state groups a pool of their own.
    `max_model_len` defaults to `max_num_batched_tokens`; `defer_block_free`
    follows `async_scheduling` unless given."""
    if kv_cache_specs is None:
        kv_cache_specs = [FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                            dtype="float32")]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(kv_cache_specs)],
        num_state_blocks=num_state_blocks,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len or max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        async_scheduling=async_scheduling,
        defer_block_free=defer_block_free,
        speculative_config=speculative_config,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                               hash_block_size=hash_block_size)
    return Scheduler(scheduler_config, kv_cache_config, cache_config)


def create_requests(
    num_requests: int,
    num_tokens: int | Sequence[int] = 10,
    max_tokens: int | Sequence[int] = 16,
    *,
    prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None = None,
    same_prompt: bool = False,
    stop_token_ids: list[int] | None = None,
    priorities: Sequence[int] | None = None,
    ignore_eos: bool = True,
    eos_token_id: int | None = None,
    min_tokens: int = 0,
    logprobs: int | None = None,
    id_offset: int = 0,
) -> list[Request]:
    """Requests with ids "0", "1", ... (shifted by `id_offset`).

    Prompts: `prompt_token_ids` (one list for all, or one per request), else
    `[i] * num_tokens` for request i (`[0] * num_tokens` with `same_prompt`).
    `num_tokens` and `max_tokens` may be one value or one per request.
    """
    requests = []
    for i in range(num_requests):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=_nth(max_tokens, i),
            min_tokens=min_tokens,
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )
        requests.append(Request(
            request_id=str(id_offset + i),
            prompt_token_ids=_prompt(i, prompt_token_ids, _nth(num_tokens, i), same_prompt),
            sampling_params=params,
            eos_token_id=eos_token_id,
            priority=priorities[i] if priorities is not None else 0,
        ))
    return requests


def _nth(value: int | Sequence[int], i: int) -> int:
    return value if isinstance(value, int) else value[i]


def _prompt(i: int, prompt_token_ids: Sequence[Sequence[int]] | Sequence[int] | None,
            num_tokens: int, same_prompt: bool) -> list[int]:
    if prompt_token_ids is not None:
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            return list(prompt_token_ids)  # type: ignore[arg-type]
        return list(prompt_token_ids[i])  # type: ignore[arg-type]
    return [0 if same_prompt else i] * num_tokens


@dataclass
class _FakeRequestState:
    prompt_len: int
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling_params.logprobs is not None


class FakeModelRunner:
    """Stands in for `ModelRunner.execute_model`: keeps per-request state from
    the `SchedulerOutput` diffs and samples one token for each request whose
    scheduled tokens reach its last known token (its own sampled tokens
    included, so it works one step ahead under async scheduling).

    The token at sequence position p of request r is a fixed function of
    (r, p) that never equals `eos_token_id`; with `eos_after=k`, every
    request's output token k (0-based) is `eos_token_id` instead. With
    `period=m`, outputs mostly repeat every m tokens (one in four positions
    breaks the pattern), so prompt-lookup drafts are partly accepted; drafts
    (`scheduled_spec_decode_tokens`) are verified greedily against these tokens.
    With `block_size`, every scheduled token must have a slot in group 0's table.
    With `draft_lookahead=k` it also plays a draft model: placeholder drafts (-1)
    are filled with a proposal that is right at two positions in three, requests
    of `draft_proposal_req_ids` must hold k slots after their sampled token, and
    those of `after_unverified_drafts_req_ids` start after their last sampled token.
    """

    def __init__(self, eos_token_id: int | None = None, eos_after: int | None = None,
                 vocab_size: int = 1000, period: int | None = None,
                 block_size: int | None = None, draft_lookahead: int = 0) -> None:
        if eos_after is not None and eos_token_id is None:
            raise ValueError("eos_after needs an eos_token_id")
        self.eos_token_id = eos_token_id
        self.eos_after = eos_after
        self.vocab_size = vocab_size
        self.period = period
        # Given: each scheduled token must have a KV slot in group 0's table.
        self.block_size = block_size
        self.draft_lookahead = draft_lookahead
        self.states: dict[str, _FakeRequestState] = {}
        self.block_copies_seen: list = []

    def token_for(self, request_id: str, position: int, prompt_len: int) -> int:
        """The token this runner samples for `request_id` at sequence `position`."""
        if self.eos_after is not None and position - prompt_len == self.eos_after:
            return self.eos_token_id  # type: ignore[return-value]
        token_id = zlib.crc32(f"{request_id}:{position}".encode()) % self.vocab_size
        if self.period is not None and token_id % 4:
            folded = prompt_len + (position - prompt_len) % self.period
            token_id = zlib.crc32(f"{request_id}:{folded}".encode()) % self.vocab_size
        if token_id == self.eos_token_id:
            token_id = (token_id + 1) % self.vocab_size
        return token_id

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        req_ids, sampled, logprobs, prompt_logprobs = [], [], [], {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self.states[req_id]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            if drafts and drafts[0] < 0:
                drafts = self._draft_model_proposal(req_id, state, len(drafts))
            if state.num_computed_tokens + num_tokens > len(state.token_ids) + len(drafts):
                raise AssertionError(f"request {req_id} scheduled past its known tokens")
            num_slots = len(state.block_ids[0]) * self.block_size if self.block_size else None
            if num_slots is not None and state.num_computed_tokens + num_tokens > num_slots:
                raise AssertionError(f"request {req_id} scheduled past its {num_slots} KV slots")
            chunk = self._prompt_logprobs_chunk(state, num_tokens)
            if chunk is not None:
                prompt_logprobs[req_id] = chunk
            state.num_computed_tokens += num_tokens
            tokens = []
            if state.num_computed_tokens == len(state.token_ids) + len(drafts):
                tokens = self._verify(req_id, state, drafts)
                state.token_ids.extend(tokens)
                state.num_computed_tokens = len(state.token_ids) - 1
                if (num_slots is not None and req_id in scheduler_output.draft_proposal_req_ids
                        and state.num_computed_tokens + self.draft_lookahead > num_slots):
                    raise AssertionError(f"request {req_id}: no room for the draft model's proposal")
            req_ids.append(req_id)
            sampled.append(tokens)
            logprobs.append([self.logprobs_for(req_id, t) for t in tokens] if state.wants_logprobs else [])
        wants_any_logprobs = any(self.states[r].wants_logprobs for r in req_ids)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 logprobs=logprobs if wants_any_logprobs else None,
                                 prompt_logprobs=prompt_logprobs or None)

    @staticmethod
    def _prompt_logprobs_chunk(state: "_FakeRequestState", num_tokens: int) -> PromptLogprobsChunk | None:
        """The prompt tokens a chunk scores, with the fixed logprobs of `_fake_logprobs`."""
        start = state.num_computed_tokens
        end = min(start + num_tokens, state.prompt_len - 1)
        if state.sampling_params.prompt_logprobs is None or len(state.token_ids) > state.prompt_len or end <= start:
            return None
        return PromptLogprobsChunk(start + 1, [_fake_logprobs(t) for t in state.token_ids[start + 1:end + 1]])

    def logprobs_for(self, request_id: str, token_id: int) -> TokenLogprobs:
        """The logprobs reported with a sampled token (a fixed function of the token)."""
        return _fake_logprobs(token_id)

    def _verify(self, req_id: str, state: _FakeRequestState, drafts: list[int]) -> list[int]:
        """The accepted prefix of `drafts` plus the token after it (greedy verification)."""
        tokens = []
        for draft in [*drafts, None]:
            token_id = self.token_for(req_id, len(state.token_ids) + len(tokens), state.prompt_len)
            tokens.append(token_id)
            if token_id != draft:
                break
        return tokens

    def _draft_model_proposal(self, req_id: str, state: "_FakeRequestState", num_tokens: int) -> list[int]:
        proposal = []
        for position in range(len(state.token_ids), len(state.token_ids) + num_tokens):
            token_id = self.token_for(req_id, position, state.prompt_len)
            wrong = zlib.crc32(f"draft:{req_id}:{position}".encode()) % 3 == 0
            proposal.append((token_id + 1) % self.vocab_size if wrong else token_id)
        return proposal

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.states.pop(req_id, None)
        self.block_copies_seen.extend(scheduler_output.kv_cache_block_copies)
        for new in scheduler_output.scheduled_new_reqs:
            self.states[new.req_id] = _FakeRequestState(
                prompt_len=len(new.prompt_token_ids),
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_computed_tokens=new.num_computed_tokens,
                block_ids=[list(ids) for ids in new.block_ids],
                sampling_params=new.sampling_params,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self.states[req_id]
            if req_id in scheduler_output.after_unverified_drafts_req_ids:
                # Counted before the previous step's drafts were settled: never ahead.
                if num_computed > state.num_computed_tokens:
                    raise AssertionError(f"request {req_id}: scheduler counts {num_computed} computed "
                                         f"tokens past the runner's {state.num_computed_tokens}")
            elif num_computed != state.num_computed_tokens:
                raise AssertionError(f"request {req_id}: scheduler says {num_computed} computed "
                                     f"tokens, runner has {state.num_computed_tokens}")
            if new_block_ids is not None:
                for table, ids in zip(state.block_ids, new_block_ids):
                    table.extend(ids)


def _fake_logprobs(token_id: int) -> TokenLogprobs:
    logprob = -float(token_id % 17) / 4.0
    return TokenLogprobs(sampled_token_id=token_id, sampled_logprob=logprob, sampled_rank=1,
                         top_token_ids=[token_id], top_logprobs=[logprob])
