"""What the engine front-end returns to users: RequestOutput and its parts."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log probability of one candidate token at one position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: candidate token id -> its Logprob. The
# sampled token is always present, plus the top N asked for.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Timings of one request, in `time.monotonic()` seconds."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def total_s(self) -> float | None:
        """Arrival to finish."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class SpecDecodeMetrics:
    """Speculative decoding for one sequence: verification steps that carried a
    draft, draft tokens proposed, and how many of them were accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when none was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step with a draft: 1 + accepted / drafts (vLLM's
        mean acceptance length); 0 when no draft was verified."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n).

    `text` and `token_ids` hold everything so far; `new_text` and
    `new_token_ids` what the latest step added, so streaming consumers need
    no diffing. `finish_reason` is None while running, then "stop", "length",
    "abort" or "error"; `stop_reason` the stop string or stop token id that
    ended it (None for EOS or length). `spec_decode` counts the drafts
    verified for it (None without speculative decoding).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    spec_decode: SpecDecodeMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at its end).

    `num_cached_tokens` counts prompt tokens served from the prefix cache.
    `prompt_logprobs` (with `SamplingParams.prompt_logprobs`, once the prompt is
    computed) has one entry per prompt token: None for the first, then a dict of
    that prompt token and the top candidates at its position.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs)
