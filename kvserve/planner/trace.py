"""Request traces for `kvserve plan` and `kvserve bench plan-check`: JSONL, one request a line.

Each line is a JSON object:

    {"arrival_s": 0.84, "prompt_len": 412, "output_len": 96, "prefix_id": "support-bot", "prefix_len": 256}

- `arrival_s` (required): seconds since the start of the trace, non-decreasing.
- `output_len` (required): tokens generated for the request.
- `prompt_len`, or `prompt_token_ids` (a list of ints): the prompt. With only a
  length, token ids are made up: the first `prefix_len` tokens are the same for
  every request with the same `prefix_id`, the rest are unique to the request.
- `prefix_id` (optional, string or int) and `prefix_len` (optional, default 0):
  which shared prefix (system prompt, few-shot block) the prompt starts with.

`kvserve bench plan-check` writes the trace it replays in this format, so a
measured run's trace can be fed back to `kvserve plan --trace`.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Iterable

# Made-up token ids stay in [_FIRST_TOKEN_ID, vocab_size): clear of the special tokens at the start.
_FIRST_TOKEN_ID = 1000


class TraceError(ValueError):
    """A trace file that cannot be read as the format above."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_id: str | None = None
    prefix_len: int = 0
    prompt_token_ids: tuple[int, ...] | None = None

    def as_json(self) -> dict[str, Any]:
        entry = {k: v for k, v in asdict(self).items() if v is not None and k != "prompt_token_ids"}
        if self.prompt_token_ids is not None:
            entry["prompt_token_ids"] = list(self.prompt_token_ids)
        return entry


def _parse_line(line: str, number: int) -> TraceRequest:
    try:
        entry = json.loads(line)
        token_ids = entry.get("prompt_token_ids")
        prompt_len = len(token_ids) if token_ids is not None else int(entry["prompt_len"])
        request = TraceRequest(
            arrival_s=float(entry["arrival_s"]), prompt_len=prompt_len, output_len=int(entry["output_len"]),
            prefix_id=None if entry.get("prefix_id") is None else str(entry["prefix_id"]),
            prefix_len=int(entry.get("prefix_len") or 0),
            prompt_token_ids=tuple(int(t) for t in token_ids) if token_ids is not None else None)
    except (ValueError, KeyError, TypeError) as exc:
        raise TraceError(f"line {number}: {exc.__class__.__name__}: {exc} (see `kvserve plan --help` "
                         "for the trace format)") from None
    if request.prompt_len < 1 or request.output_len < 1:
        raise TraceError(f"line {number}: prompt and output lengths must be >= 1")
    if not 0 <= request.prefix_len <= request.prompt_len:
        raise TraceError(f"line {number}: prefix_len {request.prefix_len} is outside 0..prompt_len")
    if request.arrival_s < 0 or math.isnan(request.arrival_s):
        raise TraceError(f"line {number}: arrival_s must be >= 0")
    return request


def read_trace(path: str) -> list[TraceRequest]:
    """The requests of a JSONL trace, in arrival order; TraceError names the first bad line."""
    with open(path) as f:
        requests = [_parse_line(line, n) for n, line in enumerate(f, 1) if line.strip()]
    if not requests:
        raise TraceError(f"{path} holds no request")
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:])):
        raise TraceError(f"{path}: arrival_s must be non-decreasing")
    return requests


def write_trace(path: str, requests: Iterable[TraceRequest]) -> str:
    with open(path, "w") as f:
        for request in requests:
            f.write(json.dumps(request.as_json()) + "\n")
    return path


def prompt_token_ids(requests: list[TraceRequest], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Each request's prompt as token ids: its own, or made up to honour its shared prefix."""
    span = vocab_size - _FIRST_TOKEN_ID
    if span < 100:
        raise TraceError(f"a vocabulary of {vocab_size} is too small for made-up prompts")
    rng = random.Random(seed)
    prefixes: dict[str, list[int]] = {}
    prompts = []
    for request in requests:
        if request.prompt_token_ids is not None:
            prompts.append(list(request.prompt_token_ids))
            continue
        prefix: list[int] = []
        if request.prefix_id is not None and request.prefix_len:
            known = prefixes.setdefault(request.prefix_id, [])
            known.extend(_FIRST_TOKEN_ID + rng.randrange(span) for _ in range(request.prefix_len - len(known)))
            prefix = known[:request.prefix_len]
        unique = [_FIRST_TOKEN_ID + rng.randrange(span) for _ in range(request.prompt_len - len(prefix))]
        prompts.append(prefix + unique)
    return prompts
