"""A bound, derived from the rounding itself, on how far a model whose matmuls round their
inputs (quantized weights: per block to int8 or int16, csrc/linear/quant_linear.c; bfloat16
weights: to bfloat16) may move the logits away from the same weights run in float32.

The derivation. The kernel rounds each activation x of a block of 32 to a multiple of
s = amax / 127 (int16: amax / 32767); the error is at most s / 2 (amax / 254, amax / 65534)
and, for values off the grid, spread evenly over [-s/2, s/2]: the classic model of
quantization noise, which holds here because the activations are not multiples of a
common step. Rounding to bfloat16 is the same with s one ulp of x (2**-7 relative to
x's power of two). How much such errors at every matmul's input move the logits depends on the
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
def dithered_inputs(model, half_steps: dict, generator: torch.Generator) -> Iterator[list[int]]:
    """Within it, every module of `model` that is a key of `half_steps` gets each element of
    its matmul's input moved by uniform noise of up to `half_steps[module](x)` (a tensor of
    x's shape; a pair of such functions also moves the output, see `_noisy_matmul`). Yields a
    one-element list counting the matmuls so perturbed. The per-op path only: `model`'s
    native decoder is switched off while inside."""
    count = [0]
    for module, half_step in half_steps.items():
        module._matmul = _noisy_matmul(module, half_step, generator, count)
    native, model._native = model._native, None
    try:
        yield count
    finally:
        model._native = native
        for module in half_steps:
            del module._matmul


def quantized_half_steps(plain, held) -> dict:
    """The modules of `plain` (float weights) whose module in `held` keeps its weight
    quantized, each with half its activation rounding step: per block of 32, amax / 254
    (int8) or amax / 65534 (int16)."""
    held_modules = dict(held.named_modules())
    steps = {}
    for name, module in plain.named_modules():
        quant = getattr(held_modules.get(name), "quant_weight", None)
        if quant is not None and hasattr(module, "_matmul"):
            steps[module] = _block_half_step(254.0 if quant.act_bits == 8 else 65534.0)
    return steps


def repacked_half_steps(plain, held) -> dict:
    """`quantized_half_steps` for weights held repacked with int16 activations, where steps of
    `panel_rows` or more take the panel GEMM (csrc/linear/quant_gemm.c). On its bfloat16 path
    (`quantized.panel_isa` == "avx512") that GEMM rounds each input x to bfloat16 (half an ulp,
    `bfloat16_half_step`) and multiplies it with the weight d * q + m rounded to bfloat16 too. A
    weight w off by e (|e| <= half its ulp <= 2**-8 |w|) adds x * e to the sum, what moving x by
    2**-8 |x| * (e / (2**-8 |w|)) adds: so the weight's rounding is drawn as a second input move
    of up to 2**-8 |x| (uniform: at least the spread of e / w, which is at most that). A step
    takes either kernel, so each input moves by the larger of the two kernels' half steps;
    on the float32 panel (AVX2, portable) the panel rounds nothing and the int16 step is it."""
    from kvserve.model import quantized

    held_modules = dict(held.named_modules())
    int16_step = _block_half_step(65534.0)

    def bf16_panel_step(x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(int16_step(x), bfloat16_half_step(x) + x.float().abs() * 2.0 ** -8)

    steps = {}
    for name, module in plain.named_modules():
        quant = getattr(held_modules.get(name), "quant_weight", None)
        if quant is not None and hasattr(module, "_matmul"):
            assert quant.act_bits == 16, "repacked_half_steps is for int16 activations"
            bf16_panel = quant.panel_rows and quantized.panel_isa(quant) == "avx512"
            steps[module] = bf16_panel_step if bf16_panel else int16_step
    return steps


def _block_half_step(divisor: float):
    def half_step(x: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(-1, x.shape[-1] // 32, 32)
        return (blocks.abs().amax(-1, keepdim=True) / divisor).expand(blocks.shape).reshape(x.shape)
    return half_step


def bfloat16_half_step(x: torch.Tensor) -> torch.Tensor:
    """Half a bfloat16 ulp of each element (8 significant bits): 2**(floor(log2|x|) - 8)."""
    exponent = torch.frexp(x.float())[1]  # |x| = m * 2**e, 0.5 <= m < 1
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 9).masked_fill(x == 0, 0.0)


def float16_half_step(x: torch.Tensor) -> torch.Tensor:
    """Half a float16 ulp of each element: 2**(floor(log2|x|) - 11) (11 significant bits), and
    2**-25 below float16's smallest normal 2**-14, where its spacing stays 2**-24."""
    exponent = torch.frexp(x.float())[1]
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), (exponent - 12).clamp(min=-25))


@contextlib.contextmanager
def dithered_kv_stores(model, half_step, generator: torch.Generator) -> Iterator[list[int]]:
    """Within it, every attention layer of `model` stores each K and V element moved by uniform
    noise of up to `half_step(x)` (what a 16-bit cache's rounding may move it; the step's own
    fresh values are used unrounded where the backend uses them, as with a 16-bit cache).
    Yields a one-element list counting the stores. The per-op path only."""
    count = [0]
    backends = {id(layer.self_attn.backend): layer.self_attn.backend for layer in model.layers}
    for backend in backends.values():
        store = type(backend).store

        def noisy(kv_cache, k, v, plan, _backend=backend, _store=store):
            count[0] += 1
            k, v = (x + (torch.rand(x.shape, generator=generator) * 2 - 1) * half_step(x) for x in (k.float(), v.float()))
            return _store(_backend, kv_cache, k, v, plan)
        backend.store = noisy
    native, model._native = model._native, None
    try:
        yield count
    finally:
        model._native = native
        for backend in backends.values():
            del backend.store


def _noisy_matmul(module, half_step, generator: torch.Generator, count: list[int]):
    """`module._matmul` with its input x moved by uniform noise of up to `half_step(x)` (a pair
    (input's, output's): the output y moved too, by up to `half_step[1](y)`, for a matmul that
    rounds its result, e.g. a bfloat16 GEMM); counts its calls in `count[0]`."""
    matmul = type(module)._matmul
    in_step, out_step = half_step if isinstance(half_step, tuple) else (half_step, None)

    def dither(x, step):
        return (x.float() + (torch.rand(x.shape, generator=generator, dtype=torch.float32) * 2 - 1) * step(x)).to(x.dtype)

    def noisy(x, *args, **kwargs):
        count[0] += 1
        y = matmul(module, dither(x, in_step), *args, **kwargs)
        return y if out_step is None else dither(y, out_step)
    return noisy


def rounding_bound(plain, half_steps: dict, logits_of: Callable[[object], dict[str, torch.Tensor]],
                   runs: int = ROUNDING_RUNS, seed: int = 0,
                   kv_half_step=None) -> tuple[dict[str, torch.Tensor], float]:
    """(the reference's logits `logits_of(plain)`, the bound on any logit's distance from them
    for rounding each input of the matmuls in `half_steps` (see `quantized_half_steps`,
    `bfloat16_half_step`) and, with `kv_half_step` (`bfloat16_half_step`, `float16_half_step`),
    every stored K/V element to the nearest step, derived as the module docstring says).
    `logits_of` runs a model on fixed tokens (teacher forcing), on a float32 KV cache."""
    reference = logits_of(plain)
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    with contextlib.ExitStack() as dithering:
        perturbed = dithering.enter_context(dithered_inputs(plain, half_steps, generator))
        stored = (dithering.enter_context(dithered_kv_stores(plain, kv_half_step, generator))
                  if kv_half_step is not None else [1])
        for _ in range(runs):
            draw = logits_of(plain)
            worst = max(worst, max((draw[r] - reference[r]).abs().max().item() for r in reference))
    assert perturbed[0] > 0 or (half_steps == {} and stored[0] > 0), "none of the rounded values was in the reference"
    scale = max(ref.abs().max().item() for ref in reference.values())
    return reference, DRAW_MARGIN * worst + 1e-5 * scale


def max_deviation(logits: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest |logit - reference| over all requests and rows (same shapes required)."""
    assert logits.keys() == reference.keys()
    assert all(logits[r].shape == reference[r].shape for r in reference)
    return max((logits[r] - reference[r]).abs().max().item() for r in reference)
