"""Whether token sequences are greedy continuations under a reference model, checked teacher
forced: the reference is fed each prompt and the tokens produced after it in one forward
pass, and at every step the token taken must have the reference's largest logit, up to
float32 rounding. Two implementations that sum in another order may break a near-tie the
other way; that is no failure, and after it both continue from the tokens actually taken.

The rounding allowance, `GREEDY_SLACK` of the logits' scale (at least 1): a float32 sum of
n <= 128 products is off by at most n * 2**-24 (8e-6) of their magnitudes; the few layers of
the tiny models, their norms and softmax compound that, 1e-4 leaves room for it and is far
below a real error (a wrong token loses by a large part of the logits' range).
"""
from __future__ import annotations

import torch

GREEDY_SLACK = 1e-4


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
