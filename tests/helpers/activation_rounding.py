"""A bound, derived from the rounding itself, on how far a model whose quantized matmuls
round their activations per block (int8 or int16, csrc/quant_linear.c) may move the logits
away from the same weights run in float32.

The derivation. The kernel rounds each activation x of a block of 32 to a multiple of
s = amax / 127 (int16: amax / 32767); the error is at most s / 2 (amax / 254, amax / 65534)
and, for values off the grid, spread evenly over [-s/2, s/2]: the classic model of
quantization noise, which holds here because the activations are not multiples of a
common step. How much such errors at every matmul's input move the logits depends on the
model (attention and the gated MLP amplify them, a random model with a large init a lot),
so it is not guessed: the float32 reference is run again `runs` times with each of those
inputs moved by independent noise drawn evenly from exactly that interval, each run one
draw of the logit error this rounding makes. The kernel's own run is one more draw of the
same spread (measured on five GGUF types, int8 and int16: 0.45 to 1.14 times the largest
of 8 draws), so the bound is twice the largest deviation of the `runs` draws, plus float32
summation order (relative 2**-24 per addition, far below int16's 2**-16 steps). None of it
depends on the CPU: the reference is float32 torch, the noise comes from a seeded generator.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

ROUNDING_RUNS = 16
# The kernel's deviation measured 0.45 to 1.14 times the largest of 8 draws: twice that of 16.
DRAW_MARGIN = 2.0


@contextlib.contextmanager
def dithered_matmul_inputs(plain, held, generator: torch.Generator) -> Iterator[list[int]]:
    """Within it, every matmul of `plain` (float weights) whose module in `held` keeps its
    weight quantized gets its input moved by uniform noise of half that weight's rounding
    step per block of 32. Yields a one-element list counting the matmuls so perturbed. The
    per-op path only: `plain`'s native decoder is switched off while inside."""
    held_modules = dict(held.named_modules())
    count = [0]
    wrapped = []
    for name, module in plain.named_modules():
        quant = getattr(held_modules.get(name), "quant_weight", None)
        if quant is None or not hasattr(module, "_matmul"):
            continue
        module._matmul = _noisy_matmul(module, 1.0 / (254.0 if quant.act_bits == 8 else 65534.0), generator, count)
        wrapped.append(module)
    native, plain._native = plain._native, None
    try:
        yield count
    finally:
        plain._native = native
        for module in wrapped:
            del module._matmul


def _noisy_matmul(module, half_step: float, generator: torch.Generator, count: list[int]):
    """`module._matmul` with its input moved by noise of up to `half_step` of each block's
    largest magnitude; counts its calls in `count[0]`."""
    matmul = type(module)._matmul

    def noisy(x, *args, **kwargs):
        blocks = x.reshape(-1, x.shape[-1] // 32, 32)
        width = blocks.abs().amax(-1, keepdim=True) * half_step
        noise = (torch.rand(blocks.shape, generator=generator, dtype=blocks.dtype) * 2 - 1) * width
        count[0] += 1
        return matmul(module, (blocks + noise).view(x.shape), *args, **kwargs)
    return noisy


def rounding_bound(plain, held, logits_of: Callable[[object], dict[str, torch.Tensor]],
                   runs: int = ROUNDING_RUNS, seed: int = 0) -> tuple[dict[str, torch.Tensor], float]:
    """(the float32 reference's logits `logits_of(plain)`, the bound on any logit's distance
    from them for `held`'s activation rounding, derived as the module docstring says).
    `logits_of` runs a model on fixed tokens (teacher forcing)."""
    reference = logits_of(plain)
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    with dithered_matmul_inputs(plain, held, generator) as perturbed:
        for _ in range(runs):
            draw = logits_of(plain)
            worst = max(worst, max((draw[r] - reference[r]).abs().max().item() for r in reference))
    assert perturbed[0] > 0, "no quantized matmul of the held model was found in the reference"
    scale = max(ref.abs().max().item() for ref in reference.values())
    return reference, DRAW_MARGIN * worst + 1e-5 * scale


def max_deviation(logits: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest |logit - reference| over all requests and rows (same shapes required)."""
    assert logits.keys() == reference.keys()
    assert all(logits[r].shape == reference[r].shape for r in reference)
    return max((logits[r] - reference[r]).abs().max().item() for r in reference)
