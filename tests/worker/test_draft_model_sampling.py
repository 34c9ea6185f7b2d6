"""Rejection sampling against a draft model's distribution keeps the target distribution.

A tiny random Llama samples 3 tokens (temperature 0.25) per request, thousands
of times, with a noisy copy of itself as the draft model. The second token is
verified: the draft sampled it from its own distribution q, which differs
clearly from the target's p, and it is accepted with min(1, p / q) or
replaced by a sample of max(p - q, 0). Given the most frequent first token,
the second must follow transformers' exact next-token distribution
(chi-square); keeping the drafts as they come would not. Accepting a draft d
with probability p(d) (the rule for a deterministic proposer) would keep p as
well, but accept less: the acceptance count must match the p / q rule's
expectation, sum over requests of sum_x min(p(x), q(x)).
"""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import sample_many
from test_draft_model import save_draft
from tiny_models import VOCAB_SIZE, chi_square_pvalue, load_reference, save_tiny_model

NUM_SAMPLES = 2000
TEMPERATURE = 0.25


@torch.inference_mode()
def _next_probs(model, tokens: list[int]) -> torch.Tensor:
    return (model(torch.tensor([tokens])).logits[0, -1].float() / TEMPERATURE).softmax(-1)


def _find_prompt(target, draft) -> tuple[list[int], int, torch.Tensor, torch.Tensor]:
    """A prompt with a likely first token t1 after which target and draft disagree
    by a total variation of 0.1 to 0.5 and the target's next token is uncertain:
    (prompt, t1, p(. | prompt + t1), q(. | prompt + t1))."""
    rng = random.Random(1)
    for _ in range(200):
        prompt = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(8, 20))]
        first = _next_probs(target, prompt)
        t1 = int(first.argmax())
        p, q = _next_probs(target, prompt + [t1]), _next_probs(draft, prompt + [t1])
        if first[t1] > 0.4 and 0.1 < 0.5 * float((p - q).abs().sum()) < 0.5 and float(p.max()) < 0.7:
            return prompt, t1, p, q
    pytest.fail("no suitable prompt found")


def test_second_token_follows_the_target_distribution(tmp_path):
    target_path = save_tiny_model("llama", tmp_path / "llama")
    draft_path = save_draft(target_path, tmp_path / "draft", noise=0.01)
    target_model, draft_model = load_reference(target_path), load_reference(draft_path)
    prompt, t1, target, draft = _find_prompt(target_model, draft_model)
    spec = {"model": draft_path, "num_speculative_tokens": 2, "disable_by_batch_size": 100_000,
            "min_acceptance_rate": 0.0, "draft_token_cost": 0.0}
    outputs, stats = sample_many(target_path, spec, prompt, NUM_SAMPLES, TEMPERATURE)
    second = [tokens[1] for tokens in outputs.values() if tokens[0] == t1]
    assert len(second) > NUM_SAMPLES * 0.3
    assert stats.num_drafts == stats.num_draft_tokens == NUM_SAMPLES  # one one-token draft each
    assert chi_square_pvalue(second, target) > 1e-3
    # The test has the power to see the draft's own distribution: it is rejected.
    assert chi_square_pvalue(second, draft) < 1e-6

    firsts = torch.bincount(torch.tensor([tokens[0] for tokens in outputs.values()]), minlength=VOCAB_SIZE)
    expected, point_mass, variance = 0.0, 0.0, 0.0
    for first in torch.nonzero(firsts).flatten().tolist():
        p = _next_probs(target_model, prompt + [first])
        q = _next_probs(draft_model, prompt + [first])
        accept = float(torch.minimum(p, q).sum())
        expected += int(firsts[first]) * accept
        point_mass += int(firsts[first]) * float((p * q).sum())
        variance += int(firsts[first]) * accept * (1 - accept)
    assert abs(stats.num_accepted_tokens - expected) < 4 * variance ** 0.5, (stats.num_accepted_tokens, expected)
    assert abs(point_mass - expected) > 10 * variance ** 0.5
