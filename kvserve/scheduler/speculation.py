"""The scheduler's side of speculative decoding: when to propose drafts, and their counts.

Prompt lookup (`ngram`) and `suffix` drafts are proposed while scheduling,
from the request's known tokens, so such a request is not scheduled ahead
under async scheduling: its step in flight may emit 1 to 1 + k tokens, and
its next draft needs them. With a draft model the runner proposes after
sampling each step and fills in placeholder drafts scheduled here, so the
request is scheduled ahead like any other: its computed tokens count no
draft until accepted, its slots cover the in-flight drafts as lookahead, and
the runner places the step after the tokens it actually sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.request import Request
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.ngram import propose_ngram
from kvserve.spec_decode.suffix import SuffixProposer

# A draft token the runner fills in (draft model): its proposal is made after the
# previous step, possibly while this one is being scheduled.
DRAFT_PLACEHOLDER = -1
# Weight of the older drafts in a request's running acceptance rate.
_ACCEPTANCE_DECAY = 0.5
# A request without verified drafts yet is assumed to accept this share, with the
# weight of one draft token (so its own outcomes take over after a draft or two).
_PRIOR_ACCEPTANCE = 0.7
_PRIOR_WEIGHT = 1.0


@dataclass
class SpecDecodingStats:
    """Draft counts since the previous report (vLLM's spec_decode counters).

    `num_accepted_tokens_per_pos[j]` counts the drafts whose token at
    position j was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def add(self, other: "SpecDecodingStats") -> None:
        """Accumulate another report into this one."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[position] += count


@dataclass
class _RequestState:
    """Recent draft outcomes of one request, for the adaptive switch-off."""

    num_misses: int = 0
    weighted_drafted: float = 0.0
    weighted_accepted: float = 0.0
    backoff_until: int = 0


class Speculator:
    """Proposes drafts for decoding requests and decides when speculation pays."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._states: dict[str, _RequestState] = {}
        self._num_schedules = 0
        self._stats = SpecDecodingStats()
        # Requests whose latest scheduled step has the runner propose drafts after it.
        self._runner_proposes: set[str] = set()
        self._suffix = None
        if config.method == "suffix":
            self._suffix = SuffixProposer(config.suffix_decoding_max_tree_depth,
                                          config.suffix_decoding_max_cached_requests,
                                          config.suffix_decoding_max_spec_factor,
                                          config.suffix_decoding_min_token_prob)

    @property
    def runner_lookahead(self) -> int:
        """Slots a step must hold after a sampling request's tokens for the runner to
        propose there (the draft model writes its KV for the draft's positions)."""
        return self.config.num_speculative_tokens if self.config.uses_draft_model else 0

    def begin_step(self) -> None:
        """Count one `schedule()` call (the clock of the back-off)."""
        self._num_schedules += 1

    def wants_drafts(self, request: Request, num_running: int) -> bool:
        """Whether `request` should speculate now (and so wait for its step in flight)."""
        if num_running >= self.config.disable_by_batch_size:
            return False
        state = self._states.get(request.request_id)
        if state is not None and state.backoff_until > self._num_schedules:
            return False
        return self.draft_length(request.request_id, num_running) > 0

    def draft_length(self, request_id: str, num_running: int) -> int:
        """The number of draft tokens (0..k) that maximizes the request's expected tokens
        per unit of step cost, given its acceptance estimate and the batch size."""
        if self.config.draft_token_cost == 0:
            return self.config.num_speculative_tokens
        state = self._states.get(request_id)
        drafted, accepted = (state.weighted_drafted, state.weighted_accepted) if state else (0.0, 0.0)
        acceptance = (accepted + _PRIOR_ACCEPTANCE * _PRIOR_WEIGHT) / (drafted + _PRIOR_WEIGHT)
        return best_draft_length(acceptance, batch_draft_cost(self.config.draft_token_cost, num_running),
                                 self.config.num_speculative_tokens)

    def propose(self, request: Request, max_num_tokens: int, num_running: int = 1) -> list[int]:
        """Draft tokens to verify after the request's last token (maybe none)."""
        num_tokens = min(self.draft_length(request.request_id, num_running), max_num_tokens)
        if num_tokens <= 0:
            return []
        if self.config.uses_draft_model:
            # Placeholders: the runner puts its proposal there (the tokens are unknown
            # here while the step that proposes them is in flight).
            proposes = request.request_id in self._runner_proposes
            return [DRAFT_PLACEHOLDER] * num_tokens if proposes else []
        elif self._suffix is not None:
            draft = self._suffix.propose(request.request_id, request.all_token_ids, num_tokens)
        else:
            draft = propose_ngram(request.all_token_ids, self.config.prompt_lookup_min,
                                  self.config.prompt_lookup_max, num_tokens)
        if not draft:
            state = self._state(request.request_id)
            state.num_misses += 1
            if state.num_misses >= self.config.max_misses:
                self._back_off(state)
        return draft

    def note_runner_proposal(self, request_id: str, proposes: bool) -> None:
        """Whether the runner proposes drafts after the step just scheduled for the request."""
        if proposes:
            self._runner_proposes.add(request_id)
        else:
            self._runner_proposes.discard(request_id)

    def record(self, request_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Account a verified draft; a request whose drafts keep failing backs off."""
        self._stats.observe(num_draft_tokens, num_accepted_tokens)
        state = self._state(request_id)
        state.num_misses = 0
        state.weighted_drafted = state.weighted_drafted * _ACCEPTANCE_DECAY + num_draft_tokens
        state.weighted_accepted = state.weighted_accepted * _ACCEPTANCE_DECAY + num_accepted_tokens
        # Judge only once a few drafts have been seen (the weights saturate at 2x a draft).
        if (state.weighted_drafted >= self.config.num_speculative_tokens
                and state.weighted_accepted < self.config.min_acceptance_rate * state.weighted_drafted):
            self._back_off(state)
        elif self.draft_length(request_id, num_running=1) == 0:
            # Not worth a draft even alone: stop, and probe again after the back-off.
            self._back_off(state)

    def forget(self, request: Request) -> None:
        """Drop a finished request's state (suffix decoding caches its outputs)."""
        self._states.pop(request.request_id, None)
        self._runner_proposes.discard(request.request_id)
        if self._suffix is not None:
            self._suffix.finish(request.request_id, request.output_token_ids)

    def take_stats(self) -> SpecDecodingStats:
        """Counts since the previous call."""
        stats, self._stats = self._stats, SpecDecodingStats()
        return stats

    def _state(self, request_id: str) -> _RequestState:
        return self._states.setdefault(request_id, _RequestState())

    def _back_off(self, state: _RequestState) -> None:
        state.backoff_until = self._num_schedules + self.config.backoff_steps
        state.num_misses = 0
        state.weighted_drafted = state.weighted_accepted = 0.0


def batch_draft_cost(draft_token_cost: float, num_running: int) -> float:
    """The cost of one draft token per request in a batch of `num_running` decodes, as a
    share of the step without drafts. A step costs a + b x tokens; `draft_token_cost`
    is b / (a + b), the share at batch 1; a batch of n gives b n / (a + b n)."""
    if draft_token_cost >= 1.0:
        return 1.0
    ratio = draft_token_cost / (1.0 - draft_token_cost) * max(num_running, 1)
    return ratio / (1.0 + ratio)


def best_draft_length(acceptance: float, draft_cost: float, max_length: int) -> int:
    """argmax over n in 0..max_length of (1 + a + a^2 + .. + a^n) / (1 + draft_cost n): the
    tokens a step emits when each draft token is accepted with probability `acceptance`
    after the previous one, over its cost. 0 when no draft beats a plain step."""
    best_length, best_gain = 0, 1.0
    expected, term = 1.0, 1.0
    for length in range(1, max_length + 1):
        term *= acceptance
        expected += term
        gain = expected / (1.0 + draft_cost * length)
        if gain > best_gain:
            best_length, best_gain = length, gain
    return best_length
