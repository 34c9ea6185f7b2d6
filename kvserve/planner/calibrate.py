"""A step-cost model for `kvserve plan` measured on a running `kvserve serve`.

The roofline model (`plan.StepCost`) is right for a machine on paper, but on a
given host the engine reaches only part of the roofline, and every step pays
Python, HTTP and sampling costs the roofline does not see. This module measures
what a step actually costs on the server that will be planned for:

- prefill: one request at a time with prompts of several lengths, max_tokens 1;
  its TTFT is the cost of a step of `prompt_len` tokens over `prompt_len` of context;
- decode: `B` requests at once for several batch sizes and prompt lengths; their
  median TPOT is the cost of a step of `B` tokens over `B * (prompt + output/2)`
  of context.

A least-squares fit (relative error, non-negative coefficients) of

    seconds = overhead + per_prefill_token * prefill_tokens + per_decode_token * decode_tokens
              + per_context_token * context_tokens

gives `Calibration`; `CalibratedStepCost` divides the token terms by the TP
size and adds the interconnect's all-reduces for TP > 1 (an extrapolation: the
calibration itself is one rank). The JSON records each sample with the fitted
value and the roofline's, so the gap between the two is visible.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from kvserve.planner.plan import Machine, ModelSpec, StepCost, tp_comm_seconds

PREFILL_LENGTHS = (32, 128, 384)
DECODE_POINTS = ((1, 32), (4, 32), (8, 32), (4, 384))
DECODE_OUTPUT_TOKENS = 24
REPEATS = 3


@dataclass(frozen=True)
class StepSample:
    """One measured step shape and its time."""

    kind: str
    num_tokens: int
    num_context_tokens: int
    seconds: float


@dataclass(frozen=True)
class Calibration:
    """The fitted step-cost coefficients and the samples behind them."""

    overhead_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_context_token_s: float
    samples: tuple[StepSample, ...] = field(default=())

    def seconds(self, num_tokens: int, num_context_tokens: int, num_decode_tokens: int = 0,
                num_sampled: int = 1) -> float:
        """One rank's step (`num_sampled` matters only to the collectives of TP > 1)."""
        return (self.overhead_s + self.per_prefill_token_s * (num_tokens - num_decode_tokens)
                + self.per_decode_token_s * num_decode_tokens + self.per_context_token_s * num_context_tokens)

    def sample_seconds(self, sample: StepSample) -> float:
        decode_tokens = sample.num_tokens if sample.kind == "decode" else 0
        return self.seconds(sample.num_tokens, sample.num_context_tokens, decode_tokens)

    def as_json(self) -> dict[str, Any]:
        return {"overhead_s": self.overhead_s, "per_prefill_token_s": self.per_prefill_token_s,
                "per_decode_token_s": self.per_decode_token_s, "per_context_token_s": self.per_context_token_s,
                "samples": [{**asdict(s), "fitted_s": self.sample_seconds(s)} for s in self.samples]}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "Calibration":
        samples = tuple(StepSample(s["kind"], s["num_tokens"], s["num_context_tokens"], s["seconds"])
                        for s in entry.get("samples", ()))
        return cls(entry["overhead_s"], entry["per_prefill_token_s"], entry["per_decode_token_s"],
                   entry["per_context_token_s"], samples)


def load_result_entry(path: str, key: str, parse, what: str):
    """`parse` of the `key` object in a bench JSON's result (or of the whole file, when bare);
    ValueError naming `what` when it is missing."""
    payload = json.loads(open(path).read())
    entry = payload.get("result", payload)
    entry = entry.get(key, entry)
    try:
        return parse(entry)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path} holds no {what} (missing {exc})") from None


def load_calibration(path: str) -> Calibration:
    """The calibration in a `kvserve bench plan-check` JSON (or a bare calibration object)."""
    return load_result_entry(path, "calibration", Calibration.from_json, "step-cost calibration")


def fit_nonnegative(features, times):
    """Coefficients minimising the relative error of `features @ c` against `times`, every one
    >= 0: the best least-squares fit over the subsets of columns whose fit has no negative term."""
    import numpy as np

    weighted = np.asarray(features, dtype=float) / np.asarray(times, dtype=float)[:, None]
    num_columns = weighted.shape[1]
    best, best_error = np.zeros(num_columns), float("inf")
    for size in range(num_columns, 0, -1):
        for columns in itertools.combinations(range(num_columns), size):
            coefficients, *_ = np.linalg.lstsq(weighted[:, columns], np.ones(len(weighted)), rcond=None)
            if (coefficients < 0).any():
                continue
            full = np.zeros(num_columns)
            full[list(columns)] = coefficients
            error = float(np.sum((weighted @ full - 1.0) ** 2))
            if error < best_error:
                best, best_error = full, error
    return [float(value) for value in best]


def fit(samples: list[StepSample]) -> Calibration:
    """Non-negative least squares on relative error, over every subset of the four terms."""
    if len(samples) < 4:
        raise ValueError("a calibration needs at least 4 samples")
    features = [[1.0, 0 if s.kind == "decode" else s.num_tokens, s.num_tokens if s.kind == "decode" else 0,
                 s.num_context_tokens] for s in samples]
    return Calibration(*fit_nonnegative(features, [s.seconds for s in samples]), tuple(samples))


@dataclass(frozen=True)
class CalibratedStepCost:
    """Step seconds from a measured one-rank `Calibration`, scaled to TP `tp`:

        overhead + [TP > 1: dispatch_overhead_s + collectives] + work_scale * token terms / tp

    `dispatch_overhead_s` and `work_scale` come from a calibration of a TP server
    (`tp_cost.fit_tp_cost`); without one they are 0 and 1 (the ideal split)."""

    calibration: Calibration
    tp: int = 1
    model: ModelSpec | None = None
    machine: Machine | None = None
    dispatch_overhead_s: float = 0.0
    work_scale: float = 1.0

    def seconds(self, num_tokens: int, num_context_tokens: int, num_decode_tokens: int = 0,
                num_sampled: int = 1) -> float:
        c = self.calibration
        work_s = c.seconds(num_tokens, num_context_tokens, num_decode_tokens) - c.overhead_s
        if self.tp <= 1:
            return c.overhead_s + work_s
        comm_s = tp_comm_seconds(self.model, self.machine, self.tp, num_tokens, num_sampled)
        return c.overhead_s + self.dispatch_overhead_s + self.work_scale * work_s / self.tp + comm_s


def roofline_gap(calibration: Calibration, model: ModelSpec, machine: Machine) -> list[dict[str, Any]]:
    """Each sample's measured time next to what the roofline predicts for it."""
    roofline = StepCost(model, machine, 1)
    return [{**asdict(s), "roofline_s": roofline.seconds(s.num_tokens, s.num_context_tokens),
             "measured_over_roofline": s.seconds / roofline.seconds(s.num_tokens, s.num_context_tokens)}
            for s in calibration.samples]


# ---------------------------------------------------------------- measuring a server

class _Prompts:
    """Fresh random token-id prompts (never the same twice, so the prefix cache never hits)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def make(self, length: int) -> list[int]:
        return [self.rng.randrange(1000, self.vocab_size) for _ in range(length)]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A streamed greedy completion of exactly `max_tokens` tokens (EOS ignored)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


async def _send_all(client, url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    from kvserve.bench.serve import stream_one

    results = await asyncio.gather(*(stream_one(client, url, completion_body(model, p, max_tokens), {})
                                     for p in prompts))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"calibration request failed: {failed[0]}")
    return results


async def measure(base_url: str, model: str, vocab_size: int, *, max_model_len: int, seed: int = 0) -> Calibration:
    """Measure prefill and decode step times on the server at `base_url` and fit them."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    prompts = _Prompts(vocab_size, seed)
    samples: list[StepSample] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
        await _send_all(client, url, model, [prompts.make(16)], 2)  # warm-up
        for length in (n for n in PREFILL_LENGTHS if n < max_model_len - 2):
            times = []
            for _ in range(REPEATS):
                (result,) = await _send_all(client, url, model, [prompts.make(length)], 1)
                times.append(result.ttft_s)
            samples.append(StepSample("prefill", length, length, statistics.median(times)))
        for batch, length in DECODE_POINTS:
            if length + DECODE_OUTPUT_TOKENS > max_model_len:
                continue
            results = await _send_all(client, url, model, [prompts.make(length) for _ in range(batch)],
                                      DECODE_OUTPUT_TOKENS)
            tpot = statistics.median(r.tpot_s for r in results)
            context = batch * (length + DECODE_OUTPUT_TOKENS // 2)
            samples.append(StepSample("decode", batch, context, tpot))
    return fit(samples)
