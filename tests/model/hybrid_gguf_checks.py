"""Checks shared by the hybrid GGUF tests (Gated DeltaNet and Mamba-2 hybrids): random
sequences clear of routing ties, the F32 file against transformers under teacher forcing, and a
Q8_0 file held as stored against the same file dequantized."""
from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.tiny_models import min_router_margin
from hybrid_runner import HybridRunner
from paged_kv_helper import held_weights, run_teacher_forced

SEQUENCE_LENGTHS = [9, 17, 26, 33, 40, 14, 21, 30, 12, 37]
VOCAB_LIMIT = 256  # token ids drawn below it (the byte-level vocabulary, no special tokens)


def clear_sequences(hf, seed: int, bound: float, experts: int) -> dict[str, list[int]]:
    """Random sequences whose every routing decision (with `experts`) is clear of a tie by more
    than twice `bound`, the most rounding can move it."""
    generator = torch.Generator().manual_seed(seed)
    candidates = {f"r{i}": torch.randint(3, VOCAB_LIMIT, (n,), generator=generator).tolist()
                  for i, n in enumerate(SEQUENCE_LENGTHS)}
    if not experts:
        return candidates
    return {r: s for r, s in candidates.items() if min_router_margin(hf, s) > 2 * bound}


def assert_float32_gguf_matches(hf, path: str, sequences: dict[str, list[int]], bound: float) -> None:
    """The F32 file on a hybrid paged cache (blocks of 4, prefill chunks of 7 beside one-token
    steps, state snapshots inside chunks) against transformers' `hf`: every row of logits of the
    sequences' second halves within `bound` of the logits' scale (at least 1)."""
    model = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    assert len(sequences) >= 3
    prompt_lens = {r: len(s) // 2 for r, s in sequences.items()}
    logits = run_teacher_forced(HybridRunner(model), sequences, prompt_lens, chunk=7)
    with torch.inference_mode():
        for req_id, tokens in sequences.items():
            ref = hf(torch.tensor([tokens])).logits[0, prompt_lens[req_id] - 1:].float()
            assert logits[req_id].shape == ref.shape
            assert (logits[req_id] - ref).abs().max().item() <= bound * max(1.0, ref.abs().max().item())


def assert_held_within_activation_rounding(path: str, kernels, sequences: dict[str, list[int]]) -> dict:
    """The quantized file held as stored under `kernels` (int16 activations) against the same
    file dequantized, fed the same tokens: within the bound that rounding every quantized
    matmul's activations gives (tests/helpers/activation_rounding.py), a bound under a tenth of
    the logits' range, so that it still tells wrong weights apart. Returns the held weights."""
    from helpers.activation_rounding import max_deviation, quantized_half_steps, rounding_bound
    held = load_model(ModelConfig.from_path(path), kernel_config=kernels)
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    weights = held_weights(held, plain)
    assert weights and all(weight.act_bits == 16 for weight in weights.values())
    prompt_lens = {r: len(s) // 2 for r, s in sequences.items()}

    def logits_of(model):
        return run_teacher_forced(HybridRunner(model), sequences, prompt_lens, chunk=7)
    reference, bound = rounding_bound(plain, quantized_half_steps(plain, held), logits_of)
    assert max_deviation(logits_of(held), reference) <= bound
    assert bound < 0.1 * min((ref.amax(-1) - ref.amin(-1)).min().item() for ref in reference.values())
    return weights
