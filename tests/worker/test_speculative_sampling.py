"""Rejection sampling through the real engine keeps the target distribution.

A tiny random Llama samples 3 tokens (temperature 0.25) per request, thousands of
times. The second token comes from a speculative step: prompt lookup drafts
what followed the first token's earlier occurrence in the prompt, and that
draft has a middling probability, so it is accepted about half of the time
and resampled from the residual otherwise. Given the most frequent first
token, the second must follow transformers' exact next-token distribution
(chi-square).
"""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import sample_many
from tiny_models import VOCAB_SIZE, chi_square_pvalue, load_reference, save_tiny_model

NUM_SAMPLES = 2000
TEMPERATURE = 0.25  # sharpens the tiny random model's flat distributions
SPEC = {"num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 1,
        "disable_by_batch_size": 100_000, "min_acceptance_rate": 0.0, "draft_token_cost": 0.0}


@torch.inference_mode()
def _next_probs(model, tokens: list[int]) -> torch.Tensor:
    return (model(torch.tensor([tokens])).logits[0, -1].float() / TEMPERATURE).softmax(-1)


def _find_prompt(model) -> tuple[list[int], int, int, torch.Tensor]:
    """A prompt whose likely first token t1 occurs in it, followed there by a token d
    with a middling p(d | prompt + t1): (prompt, t1, d, p(. | prompt + t1))."""
    rng = random.Random(0)
    for _ in range(200):
        head = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(8, 20))]
        tail = [rng.randrange(3, VOCAB_SIZE) for _ in range(3)]
        t1 = int(_next_probs(model, head + tail).argmax())
        d = int(_next_probs(model, head + tail + [t1]).argsort()[-2])
        prompt = head + [t1, d] + tail
        first = _next_probs(model, prompt)
        second = _next_probs(model, prompt + [t1])
        if int(first.argmax()) == t1 and first[t1] > 0.3 and 0.2 < second[d] < 0.8:
            return prompt, t1, d, second
    pytest.fail("no suitable prompt found")


def test_second_token_follows_the_target_distribution(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    prompt, t1, draft, target = _find_prompt(load_reference(path))
    outputs, stats = sample_many(path, SPEC, prompt, NUM_SAMPLES, TEMPERATURE)
    second = [tokens[1] for tokens in outputs.values() if tokens[0] == t1]
    assert len(second) > NUM_SAMPLES * 0.25
    assert stats.num_drafts >= len(second) and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert chi_square_pvalue(second, target) > 1e-3
    assert abs(second.count(draft) / len(second) - float(target[draft])) < 0.06
