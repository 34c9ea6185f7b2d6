"""Sampling parameters of one request, validated at construction.

Pure Python (no torch) so the scheduler can read the fields it needs
(max_tokens, min_tokens, stop_token_ids, ignore_eos) without a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import SamplingParamsError

__all__ = ["SamplingParams", "SamplingParamsError"]


@dataclass
class SamplingParams:
    """How to sample the tokens of one request (OpenAI/vLLM semantics).

    temperature 0 means greedy. top_k <= 0 or None disables top-k; top_p 1.0
    and min_p 0.0 disable those filters. `stop` strings are matched by the
    detokenizer and are not part of the returned text. `logprobs=N` returns
    the sampled token's logprob plus the top N.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def fail(name: str, why: str) -> None:
            raise SamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < -1):
            fail("top_k", "must be an integer >= -1 (-1 or 0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            fail("repetition_penalty", "must be in (0, 10]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            fail("logprobs", "must be an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must hold non-negative integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
