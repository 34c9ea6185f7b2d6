"""From engine-core outputs (token ids) to user-facing RequestOutputs (text).

A request with `n > 1` becomes n child requests in the engine core, ids
`f"{index}_{request_id}"`, with the same prompt: the prefix cache then serves
the children's prompts from one set of blocks. The processor gathers the
children back into one RequestOutput. Stop strings are found here (the core
only sees token ids), so a stop-string finish hands the caller the engine
ids to abort.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    SpecDecodeMetrics,
)
from kvserve.sampling_params import SamplingParams
from kvserve.messages import EngineCoreOutput, TokenLogprobs

if TYPE_CHECKING:
    from kvserve.engine.core import EngineCoreRequest


def child_request_id(index: int, request_id: str) -> str:
    """Engine-core id of sequence `index` of a request with n > 1."""
    return f"{index}_{request_id}"


@dataclass
class ProcessedOutputs:
    """Result of one `process_outputs` call."""

    request_outputs: list[RequestOutput]
    # Engine ids of sequences that a stop string finished: abort them in the core.
    request_ids_to_abort: list[str]


@dataclass
class _SequenceState:
    engine_request_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    spec_decode: SpecDecodeMetrics | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    final_only: bool
    sequences: list[_SequenceState] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)


class OutputProcessor:
    """Tracks live requests between the caller and the engine core.

    `add_request` returns the engine-core requests to submit; each step's
    `process_outputs` returns the RequestOutputs that changed (streaming) or
    finished (`final_only`), and the engine ids to abort.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        self._sequences: dict[str, tuple[_RequestState, _SequenceState]] = {}
        self._decoded_token_cache: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        *,
        priority: int = 0,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        final_only: bool = False,
    ) -> list["EngineCoreRequest"]:
        """Register a request; returns the engine-core requests to add (n of them)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        state = _RequestState(request_id, prompt, list(prompt_token_ids), sampling_params,
                              RequestMetrics(arrival_time), final_only)
        core_requests = []
        for index, child_params in enumerate(_child_sampling_params(sampling_params)):
            engine_id = request_id if sampling_params.n == 1 else child_request_id(index, request_id)
            seq = self._new_sequence(engine_id, index, state.prompt_token_ids, child_params)
            state.sequences.append(seq)
            self._sequences[engine_id] = (state, seq)
            core_requests.append(_make_core_request(
                engine_id, state.prompt_token_ids, child_params, eos_token_id, arrival_time,
                priority, cache_salt))
        self._requests[request_id] = state
        return core_requests

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids still running in the core."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        for seq in state.sequences:
            self._sequences.pop(seq.engine_request_id, None)
        return [seq.engine_request_id for seq in state.sequences if seq.finish_reason is None]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def process_outputs(self, engine_core_outputs: Sequence[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's outputs; return changed RequestOutputs and ids to abort."""
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for core_output in engine_core_outputs:
            entry = self._sequences.get(core_output.request_id)
            if entry is None:
                continue  # aborted by the caller, or already finished by a stop string
            state, seq = entry
            if self._apply(state, seq, core_output, now):
                to_abort.append(seq.engine_request_id)
            touched[state.request_id] = state
        request_outputs = []
        for state in touched.values():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                self._forget(state)
            if finished or not state.final_only:
                request_outputs.append(self._make_request_output(state, finished))
        return ProcessedOutputs(request_outputs, to_abort)

    def _new_sequence(self, engine_id: str, index: int, prompt_token_ids: list[int],
                      params: SamplingParams) -> _SequenceState:
        want_logprobs = params.logprobs is not None
        return _SequenceState(
            engine_id, index, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
            logprobs=[] if want_logprobs else None,
            cumulative_logprob=0.0 if want_logprobs else None)

    def _apply(self, state: _RequestState, seq: _SequenceState, core_output: EngineCoreOutput,
               now: float) -> bool:
        """Update one sequence; True when a stop string ended it before the core did."""
        if core_output.num_cached_tokens:
            state.num_cached_tokens = max(state.num_cached_tokens, core_output.num_cached_tokens)
        if core_output.prompt_logprobs is not None and state.prompt_logprobs is None:
            # The first prompt token has no context to be scored in: None, as vLLM returns.
            state.prompt_logprobs = [None] + [self._position_logprobs(entry) for entry in core_output.prompt_logprobs]
        if core_output.new_token_ids and state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        if core_output.num_draft_tokens:
            spec = seq.spec_decode = seq.spec_decode or SpecDecodeMetrics()
            spec.num_drafts += 1
            spec.num_draft_tokens += core_output.num_draft_tokens
            spec.num_accepted_tokens += core_output.num_accepted_tokens
        detok = seq.detokenizer
        num_tokens_before = len(detok.token_ids)
        stop_by_token = core_output.finish_reason == "stop" and not isinstance(core_output.stop_reason, str)
        stop_string = detok.update(core_output.new_token_ids, stop_terminated=stop_by_token)
        seq.new_token_ids.extend(detok.token_ids[num_tokens_before:])
        if seq.logprobs is not None and core_output.new_logprobs:
            num_kept = len(detok.token_ids) - num_tokens_before
            self._append_logprobs(seq, core_output.new_logprobs[:num_kept])
        if stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
            self._sequences.pop(seq.engine_request_id, None)
            return not core_output.finished
        if core_output.finished:
            detok.flush()
            seq.finish_reason, seq.stop_reason = core_output.finish_reason, core_output.stop_reason
            self._sequences.pop(seq.engine_request_id, None)
        return False

    def _append_logprobs(self, seq: _SequenceState, token_logprobs: Sequence[TokenLogprobs]) -> None:
        for entry in token_logprobs:
            seq.logprobs.append(self._position_logprobs(entry))
            seq.cumulative_logprob += entry.sampled_logprob

    def _position_logprobs(self, entry: TokenLogprobs | None) -> PositionLogprobs | None:
        """The top candidates, then the position's own token (sampled or prompt)."""
        if entry is None:
            return None
        position: PositionLogprobs = {}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), 1):
            position[token_id] = Logprob(logprob, rank, self._decode_token(token_id))
        position[entry.sampled_token_id] = Logprob(
            entry.sampled_logprob, entry.sampled_rank, self._decode_token(entry.sampled_token_id))
        return position

    def _decode_token(self, token_id: int) -> str:
        text = self._decoded_token_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._decoded_token_cache[token_id] = text
        return text

    def _make_request_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        completions = [self._make_completion(seq, finished) for seq in state.sequences]
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=completions, finished=finished, num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics, prompt_logprobs=state.prompt_logprobs)

    @staticmethod
    def _make_completion(seq: _SequenceState, request_finished: bool) -> CompletionOutput:
        seq_finished = request_finished or seq.finish_reason is not None
        detok = seq.detokenizer
        text = detok.get_next_output_text(seq_finished, delta=False)
        new_text = detok.get_next_output_text(seq_finished, delta=True)
        new_token_ids, seq.new_token_ids = seq.new_token_ids, []
        return CompletionOutput(
            index=seq.index, text=text, token_ids=list(detok.token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            new_text=new_text, new_token_ids=new_token_ids,
            spec_decode=dataclasses.replace(seq.spec_decode) if seq.spec_decode is not None else None)

    def _forget(self, state: _RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for seq in state.sequences:
            self._sequences.pop(seq.engine_request_id, None)


def _child_sampling_params(params: SamplingParams) -> list[SamplingParams]:
    """Per-sequence params: n = 1 each; seeded requests get distinct seeds so
    the n samples differ but stay reproducible."""
    if params.n == 1:
        return [params]
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            for index in range(params.n)]


def _make_core_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_id: int | None, arrival_time: float, priority: int,
                       cache_salt: str | None) -> "EngineCoreRequest":
    # Imported here: the core pulls in the worker (torch), which callers that
    # only detokenize (tests, the server's protocol layer) do not need.
    from kvserve.engine.core import EngineCoreRequest
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
        eos_token_id=eos_token_id, arrival_time=arrival_time, priority=priority, cache_salt=cache_salt)
