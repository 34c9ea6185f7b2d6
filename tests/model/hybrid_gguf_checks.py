"""Checks shared by the hybrid GGUF tests (Gated DeltaNet and Mamba-2 hybrids): random
sequences clear of routing ties, the F32 file against transformers under teacher forcing, and a
Q8_0 file held as stored against the same file dequantized."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import transformers

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.tiny_models import min_router_margin
from hybrid_runner import HybridRunner
from paged_kv_helper import held_weights, load_hf, run_teacher_forced

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


def gguf_getter(tmp_path_factory, hf_config: Callable[[str, int], Any], extra_args: tuple[str, ...] = ()):
    """A getter (variant, outtype) -> (transformers' float32 model, its directory, the GGUF
    path): the tiny model `hf_config(variant, vocab_size)` with random weights (seed 0) and the
    byte-level tokenizer saved, converted by llama.cpp's convert_hf_to_gguf.py (the calling test
    skipped where it is not available) once per outtype."""
    from helpers.gpt_oss_gguf import MERGES, convert_to_gguf, converter_or_skip
    from helpers.harmony_model import harmony_tokenizer
    converter = converter_or_skip()
    made = {}

    def get(variant: str, outtype: str = "f32"):
        if variant not in made:
            root = tmp_path_factory.mktemp(variant)
            tokenizer = harmony_tokenizer(MERGES)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf_config(variant, len(tokenizer)))
            model.eval().save_pretrained(str(root))
            tokenizer.save_pretrained(str(root))
            made[variant] = (load_hf(str(root)), str(root))
        hf, directory = made[variant]
        path = os.path.join(directory, f"tiny-{outtype}.gguf")
        if not os.path.exists(path):
            convert_to_gguf(directory, path, converter, pre="qwen2", outtype=outtype, extra_args=extra_args)
        return hf, directory, path
    return get


def kvserve_generate(path: str, prompt: str) -> subprocess.CompletedProcess:
    """`kvserve generate --json` of 6 greedy tokens in float32 on the file, prefix caching on."""
    return subprocess.run([sys.executable, "-m", "kvserve", "generate", "--model", path, "--json", "--max-tokens", "6",
                           "--temperature", "0", "--no-chat-template", "--quantization", "none", "--dtype",
                           "float32", prompt], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KVSERVE_LOG_LEVEL": "ERROR"})


def assert_generate_answers(hf, directory: str, path: str, bound: float) -> None:
    """`kvserve generate` on the file: each token it picks is transformers' argmax on the same
    sequence (teacher forced), or within twice `bound` of it (a near-tie either may break its way)."""
    prompt = "hello world"
    result = kvserve_generate(path, prompt)
    assert result.returncode == 0, result.stderr[-2000:]
    reply = json.loads(result.stdout.strip().splitlines()[-1])
    prompt_ids = transformers.AutoTokenizer.from_pretrained(directory).encode(prompt)
    assert reply["num_prompt_tokens"] == len(prompt_ids) and reply["num_generated_tokens"] == 6
    tokens = reply["token_ids"]
    with torch.inference_mode():
        rows = hf(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    for token, row in zip(tokens, rows):
        assert row.max().item() - row[token].item() <= 2 * bound * max(1.0, row.abs().max().item())
