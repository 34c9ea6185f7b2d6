"""`SpeculativeConfig`: vLLM's `speculative_config` dict, validated.

Importing this module needs no torch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model", "suffix")
_FLOAT_KEYS = ("min_acceptance_rate", "draft_token_cost", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# Batches this large run without drafts: on a CPU a step of a few requests is
# already compute-bound, so verifying k more tokens per request costs about as
# much as the memory pass over the weights it saves (bench spec, unrelated batch).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
# Verifying one more token at batch 1 costs about a quarter of a decode step of the
# default model on the CPU. From the quiet bench spec run (grounded, k=4): 1140 tokens
# at 1.70x took ~670 plain-step times; 282 plain steps plus 195 steps with ~4 drafts
# each, so such a step cost ~2.0 plain steps (prefill, common to both, counted as decode).
DEFAULT_DRAFT_TOKEN_COST = 0.25


class SpeculativeConfigError(ValueError):
    """A `speculative_config` value is invalid; the message names it."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and when speculation is switched off.

    `ngram` (prompt lookup): the longest suffix of the request's tokens, of
    `prompt_lookup_min`..`prompt_lookup_max` tokens, is searched in its earlier
    tokens (prompt and outputs); the tokens that followed its latest earlier
    occurrence are the draft, at most `num_speculative_tokens` of them.

    Adaptive: no drafts while `disable_by_batch_size` or more requests run; a
    request whose drafts keep failing (acceptance below `min_acceptance_rate`
    over its recent drafts, or no match `max_misses` times in a row) stops
    proposing for `backoff_steps` steps and runs like a request without
    speculation (scheduled ahead under async scheduling). Each draft is as long
    as pays best: with `draft_token_cost` c the cost of one draft token as a
    share of a one-request decode step (a batch of n makes it r n / (1 + r n),
    r = c / (1 - c)) and a the request's recent acceptance rate, the length n in
    0..k maximizing (1 + a + .. + a^n) / (1 + cost n); 0 skips the draft (and
    backs off when even a lone request would not gain). c = 0 always drafts k.

    `draft_model`: a smaller model at `model` (same vocabulary as the target)
    proposes `num_speculative_tokens` tokens autoregressively after each
    verified step; its KV lives in its own groups of the target's KV-cache
    manager. Given `model` without `method`, the method is `draft_model` (vLLM).

    `suffix` (vLLM's suffix decoding, `spec_decode/suffix.py`): suffix trees of
    the request's tokens and of the outputs of the last
    `suffix_decoding_max_cached_requests` finished requests, cut at
    `suffix_decoding_max_tree_depth`; a draft follows the most frequent
    continuation while each token's share is >= `suffix_decoding_min_token_prob`,
    at most `suffix_decoding_max_spec_factor` x the matched length.
    """

    method: str = "ngram"
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = 0.2
    draft_token_cost: float = DEFAULT_DRAFT_TOKEN_COST
    max_misses: int = 6
    backoff_steps: int = 8
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise SpeculativeConfigError(
                f"speculative_config: method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("prompt_lookup_min", self.prompt_lookup_min)
        _check_positive("prompt_lookup_max", self.prompt_lookup_max)
        _check_positive("disable_by_batch_size", self.disable_by_batch_size)
        _check_positive("backoff_steps", self.backoff_steps)
        _check_positive("max_misses", self.max_misses)
        if self.method == "draft_model" and not self.model:
            raise SpeculativeConfigError('speculative_config: method "draft_model" needs "model" (the draft\'s path)')
        if self.method == "ngram" and self.model:
            raise SpeculativeConfigError('speculative_config: "model" is only used with method "draft_model"')
        _check_positive("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        if self.suffix_decoding_max_cached_requests < 0:
            raise SpeculativeConfigError("speculative_config: suffix_decoding_max_cached_requests must be >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise SpeculativeConfigError("speculative_config: suffix_decoding_max_spec_factor must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise SpeculativeConfigError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1]")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                f"speculative_config: prompt_lookup_min {self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max {self.prompt_lookup_max}")
        if not 0.0 <= self.draft_token_cost <= 1.0:
            raise SpeculativeConfigError(
                f"speculative_config: draft_token_cost must be in [0, 1], got {self.draft_token_cost}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise SpeculativeConfigError(
                f"speculative_config: min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")

    @property
    def uses_draft_model(self) -> bool:
        """Drafts come from a draft model in the worker (not from the scheduler)."""
        return self.method == "draft_model"

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict (vLLM's keys) or its JSON text; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(
                f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        for key, expected in (("method", str), ("model", str)):
            if key in value and value[key] is not None and not isinstance(value[key], expected):
                raise SpeculativeConfigError(f"speculative_config: {key} must be a string")
        for key in _FLOAT_KEYS:
            if key in value and (not isinstance(value[key], (int, float)) or isinstance(value[key], bool)):
                raise SpeculativeConfigError(f"speculative_config: {key} must be a number, got {value[key]!r}")
        for key in known - {"method", "model", *_FLOAT_KEYS}:
            if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool)):
                raise SpeculativeConfigError(
                    f"speculative_config: {key} must be an integer, got {value[key]!r}")
        return cls(**_with_vllm_defaults(value))


def _with_vllm_defaults(value: dict[str, Any]) -> dict[str, Any]:
    """vLLM's implied values: `model` alone means a draft model; only one of the
    prompt-lookup bounds given sets the other."""
    value = dict(value)
    if value.get("model") and "method" not in value:
        value["method"] = "draft_model"
    if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
        value["prompt_lookup_min"] = min(2, value["prompt_lookup_max"])
    if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
        value["prompt_lookup_max"] = max(value["prompt_lookup_min"], 5)
    return value


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise SpeculativeConfigError(f"speculative_config: {name} must be >= 1, got {value}")
