"""Whether token sequences are greedy continuations under a reference model, checked teacher
forced: the reference is fed each prompt and the tokens produced after it in one forward
pass, and at every step the token taken must have the reference's largest logit, up to
float32 rounding. Two implementations that sum in another order may break a near-tie the
other way; that is no failure, and after it both continue from the tokens actually taken.

The rounding allowance, `GREEDY_SLACK` of the logits' scale (at least 1): float32 summation
order in the tiny models (tests/helpers/float_order.py derives it), far below a real error (a
wrong token loses by a large part of the logits' range).

Seeded samples are checked the same way (`assert_seeded_samples`): what is identical by
design between two engines is the request's noise, not its logits. The sampler takes
argmax_i (log p_i - log E_i) with E the seeded exponential noise (`seeded_noise`, one draw
per token), so given that noise the sample is an argmax too: of log p computed from the
reference's logits, up to twice the rounding allowance over the temperature (see there).
"""
from __future__ import annotations

import torch

from kvserve.sample.sampler import make_generator, seeded_noise

from helpers.float_order import TINY_MODEL_REORDER_BOUND

GREEDY_SLACK = TINY_MODEL_REORDER_BOUND


@torch.inference_mode()
def greedy_shortfalls(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """For each token taken after `prompt`, how far its logit under the transformers `model`
    falls short of that step's largest, relative to the logits' scale (at least 1)."""
    if not tokens:
        return torch.zeros(0)
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()
    taken = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return (logits.max(-1).values - taken) / logits.abs().max().clamp(min=1.0)


def assert_greedy_continuations(model, prompts: list[list[int]], outputs: list[list[int]],
                                num_tokens: int | None = None) -> None:
    """Each of `outputs` is a greedy continuation of its prompt under `model` (up to
    `GREEDY_SLACK`), of exactly `num_tokens` tokens where given."""
    assert len(outputs) == len(prompts)
    for prompt, tokens in zip(prompts, outputs):
        if num_tokens is not None:
            assert len(tokens) == num_tokens, (prompt, tokens)
        shortfall = greedy_shortfalls(model, prompt, tokens)
        assert (shortfall <= GREEDY_SLACK).all(), (prompt, tokens, shortfall.tolist())


@torch.inference_mode()
def assert_seeded_samples(model, prompt: list[int], tokens: list[int], seed: int, temperature: float,
                          top_k: int = 0, allowed: list[torch.Tensor] | None = None) -> None:
    """`tokens`, sampled after `prompt` with `seed`, `temperature` and `top_k` (0: off), each
    under `allowed[k]` (bool [vocab], a grammar's mask) where given, are the draws that seed
    gives from the transformers `model`'s distribution, fed the tokens taken (teacher forcing).

    Slack: an engine's logits are within delta = `GREEDY_SLACK` * scale of the reference's (the
    module's rounding allowance); token i's score log p_i - log E_i = L_i / T - logsumexp - log E_i,
    and the logsumexp is common to every token, so two tokens' score difference moves by at most
    2 * delta / T. Under top-k only the tokens beyond delta of the k-th logit are surely in the
    engine's set: the token taken must be within 2 * delta of it and beat those within the slack."""
    if not tokens:
        return
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()
    assert_seeded_draws(logits, tokens, seed, temperature, GREEDY_SLACK * float(logits.abs().max().clamp(min=1.0)),
                        top_k, allowed)


def assert_seeded_draws(logits: torch.Tensor, tokens: list[int], seed: int, temperature: float, delta: float,
                        top_k: int = 0, allowed: list[torch.Tensor] | None = None) -> None:
    """`tokens` are the draws `seed` gives (see `assert_seeded_samples`) from reference `logits`
    [len(tokens), vocab] (row k: the logits that chose token k, teacher forced) of an engine
    whose logits lie within `delta` of them."""
    generator = make_generator(seed)
    for k, token_id in enumerate(tokens):
        row = logits[k].clone()
        noise = seeded_noise(generator, row.shape[0])
        if allowed is not None:
            assert allowed[k][token_id], (k, tokens)
            row[~allowed[k]] = float("-inf")
        candidates = torch.isfinite(row)
        if top_k:
            kth = row.topk(min(top_k, int(candidates.sum()))).values[-1]
            assert row[token_id] >= kth - 2 * delta, (k, tokens)
            candidates &= row >= kth + 2 * delta
        score = row / temperature - noise.log()
        best = score[candidates].max() if candidates.any() else score[token_id]
        assert score[token_id] >= best - 2 * delta / temperature, (k, tokens, float(best - score[token_id]))
