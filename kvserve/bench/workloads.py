"""Deterministic benchmark workloads: the same seed gives the same requests everywhere.

Prompts are token-id lists (exact lengths, identical for every engine compared)
or, for HTTP serving, text built from a fixed word list. Every engine gets
`ignore_eos` with a per-request output length, so the work done is fixed.

Workloads:
- fixed: N prompts of `prompt_len` tokens, each generating `output_len` tokens.
- mixed: a chat-like spread: prompt lengths log-normal (median 256 tokens,
  clipped to 16..1024), output lengths log-normal (median 96, clipped to 8..512),
  drawn independently with a seeded RNG.
- single: the fixed workload with one request (single-stream speed).
- ragged: 16 prompts of uniformly drawn lengths (40..160 tokens), 64 new
  tokens each: one batch of prompts of different lengths (padding waste).
- prefill: one 512-token prompt, one new token: the time is the TTFT
  (prompt processing speed).
- shared_prefix: one long system prompt shared by every request plus a short
  distinct question each (prefix-caching benchmark).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Ids below this are kept out of generated prompts: tokenizers put special and
# control tokens at the start of the vocabulary.
_FIRST_ORDINARY_TOKEN_ID = 256

_WORDS = (
    "the model reads each token and writes the next one while the cache keeps keys and values "
    "for every block of the prompt so a second request with the same prefix can skip the work "
    "engines batch many requests together because one matrix multiply over many rows costs "
    "little more than one row when memory bandwidth is the limit rivers mountains weather "
    "history music language science cooking travel garden city ocean forest library market"
).split()


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its prompt token ids and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    """A named, reproducible list of requests."""

    name: str
    requests: list[BenchRequest]
    description: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "num_requests": len(self.requests),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "max_prompt_len": max((r.prompt_len for r in self.requests), default=0),
            "max_output_len": max((r.output_len for r in self.requests), default=0),
        }


def random_token_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    low = min(_FIRST_ORDINARY_TOKEN_ID, max(0, vocab_size // 2))
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def fixed_workload(num_requests: int = 32, prompt_len: int = 64, output_len: int = 128, *,
                   vocab_size: int, seed: int = 0) -> Workload:
    """N distinct prompts of the same length, each generating the same number of tokens."""
    rng = random.Random(seed)
    requests = [BenchRequest(random_token_ids(rng, prompt_len, vocab_size), output_len)
                for _ in range(num_requests)]
    return Workload("fixed", requests,
                    f"{num_requests} prompts x {prompt_len} tokens, {output_len} new tokens each (ignore_eos)")


def _lognormal_length(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def mixed_workload(num_requests: int = 64, *, vocab_size: int, seed: int = 0,
                   prompt_median: int = 256, output_median: int = 96,
                   max_prompt_len: int = 1024, max_output_len: int = 512, sigma: float = 0.8) -> Workload:
    """Chat-like lengths: log-normal prompts and outputs, seeded, clipped to the given bounds."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = _lognormal_length(rng, prompt_median, sigma, min(16, max_prompt_len), max_prompt_len)
        output_len = _lognormal_length(rng, output_median, sigma, min(8, max_output_len), max_output_len)
        requests.append(BenchRequest(random_token_ids(rng, prompt_len, vocab_size), output_len))
    description = (f"{num_requests} requests; prompt lengths log-normal(median {prompt_median}, sigma {sigma}) "
                   f"clipped to [16, {max_prompt_len}], output lengths log-normal(median {output_median}, "
                   f"sigma {sigma}) clipped to [8, {max_output_len}]; seed {seed}; ignore_eos")
    return Workload("mixed", requests, description)


def shared_prefix_workload(num_requests: int = 32, prefix_len: int = 1024, question_len: int = 24,
                           output_len: int = 16, *, vocab_size: int, seed: int = 0) -> Workload:
    """One long shared system prompt followed by a distinct short question per request."""
    rng = random.Random(seed)
    prefix = random_token_ids(rng, prefix_len, vocab_size)
    requests = [BenchRequest(prefix + random_token_ids(rng, question_len, vocab_size), output_len)
                for _ in range(num_requests)]
    return Workload("shared_prefix", requests,
                    f"{num_requests} requests sharing a {prefix_len}-token prefix, each with a distinct "
                    f"{question_len}-token question, {output_len} new tokens each")


def text_prompts(num_prompts: int, num_words: int, *, seed: int = 0) -> list[str]:
    """Distinct plain-text prompts of `num_words` words each (about one token per word)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(num_words)) for _ in range(num_prompts)]


def ragged_workload(num_requests: int = 16, min_prompt_len: int = 40, max_prompt_len: int = 160,
                    output_len: int = 64, *, vocab_size: int, seed: int = 0) -> Workload:
    """Prompts of uniformly drawn lengths, all generating `output_len` tokens."""
    rng = random.Random(seed)
    requests = [BenchRequest(random_token_ids(rng, rng.randint(min_prompt_len, max_prompt_len), vocab_size),
                             output_len) for _ in range(num_requests)]
    return Workload("ragged", requests, f"{num_requests} prompts of {min_prompt_len}..{max_prompt_len} tokens "
                                        f"(uniform, seed {seed}), {output_len} new tokens each (ignore_eos)")


def prefill_workload(prompt_len: int = 512, *, vocab_size: int, seed: int = 0) -> Workload:
    """One prompt and one new token: the elapsed time is the time to first token."""
    workload = fixed_workload(1, prompt_len, 1, vocab_size=vocab_size, seed=seed)
    return Workload("prefill", workload.requests, f"prompt processing: one {prompt_len}-token prompt, "
                                                  f"1 new token (elapsed = TTFT)")


WORKLOAD_NAMES = ("fixed", "mixed", "single", "ragged", "prefill")


def build_workload(name: str, *, vocab_size: int, num_requests: int | None = None, prompt_len: int = 64,
                   output_len: int = 128, seed: int = 0, max_prompt_len: int = 1024,
                   max_output_len: int = 512, prefill_len: int = 512) -> Workload:
    """A workload by name; `num_requests` None means the workload's default size.

    `prompt_len`/`output_len` size the fixed workload; the max lengths clip the
    mixed one (a tiny CI run clips it hard; the shape of the code path is the same).
    """
    if name == "fixed":
        return fixed_workload(num_requests or 32, prompt_len, output_len, vocab_size=vocab_size, seed=seed)
    if name == "single":
        workload = fixed_workload(num_requests or 1, prompt_len, output_len, vocab_size=vocab_size, seed=seed)
        return Workload("single", workload.requests, "single stream: " + workload.description)
    if name == "ragged":
        return ragged_workload(num_requests or 16, vocab_size=vocab_size, seed=seed)
    if name == "prefill":
        return prefill_workload(prefill_len, vocab_size=vocab_size, seed=seed)
    if name == "mixed":
        return mixed_workload(num_requests or 64, vocab_size=vocab_size, seed=seed,
                              max_prompt_len=max_prompt_len, max_output_len=max_output_len)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
