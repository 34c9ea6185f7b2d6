"""Sampling parameters of one request, validated at construction.

Pure Python (no torch) so the scheduler can read the fields it needs
(max_tokens, min_tokens, stop_token_ids, ignore_eos) without a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import SamplingParamsError

__all__ = ["SamplingParams", "SamplingParamsError"]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's shape): exactly one of

    - `json`: a JSON schema (dict or JSON text) the output must validate against;
    - `regex`: a regular expression the whole output must match;
    - `choice`: the output is one of these strings;
    - `grammar`: a Lark or GBNF (llama.cpp EBNF) grammar;
    - `json_object=True`: any JSON object.

    The engine compiles it into a token mask (`kvserve.sample.structured.grammar`).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise SamplingParamsError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise SamplingParamsError("structured_outputs.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}")
        self.kind  # noqa: B018  (validates the value's type)

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for name, types in (("json", (dict, str)), ("regex", str), ("grammar", str), ("choice", tuple)):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, types):
                    raise SamplingParamsError(f"structured_outputs.{name} has the wrong type: {value!r}")
                return name
        return "json_object"


@dataclass
class SamplingParams:
    """How to sample the tokens of one request (OpenAI/vLLM semantics).

    temperature 0 means greedy. top_k <= 0 or None disables top-k; top_p 1.0
    and min_p 0.0 disable those filters. `stop` strings are matched by the
    detokenizer and are not part of the returned text. `logprobs=N` returns
    the sampled token's logprob plus the top N; `prompt_logprobs=N` returns each
    prompt token's logprob given the ones before it, plus the top N there (the
    first prompt token has none: None in its place). A request asking for prompt
    logprobs computes its whole prompt (no prefix-cache hit).
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        else:
            self.logit_bias = None
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
        if self.prompt_logprobs is not None and (
                isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
                or not 0 <= self.prompt_logprobs <= 20):
            fail("prompt_logprobs", "must be an integer in [0, 20]")
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


def _checked_logit_bias(logit_bias: Any) -> dict[int, float]:
    """{token id: bias in [-100, 100]} with integer keys (OpenAI sends them as strings)."""
    if not isinstance(logit_bias, dict):
        raise SamplingParamsError(f"logit_bias must map token ids to numbers, got {logit_bias!r}")
    checked = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            raise SamplingParamsError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token_id < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise SamplingParamsError(f"logit_bias[{key!r}] must be a number in [-100, 100] for a token id >= 0, "
                                      f"got {value!r}")
        checked[token_id] = float(value)
    return checked
