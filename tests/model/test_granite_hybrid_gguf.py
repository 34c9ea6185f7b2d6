"""Granite 4 hybrids from GGUF (#29, llama.cpp's `granitehybrid`): tiny random
GraniteMoeHybridForCausalLM models (tests/helpers/tiny_models.py), with routed and shared
experts and with the shared MLP alone, converted by llama.cpp's own convert_hf_to_gguf.py
(llama-cpp-python 0.3.36's sdist) to F32 and Q8_0, loaded by kvserve: the config read from the
GGUF keys equals the one read from the HF directory; the F32 file matches transformers in
float32 under teacher forcing; the Q8_0 file's weights held as stored run within the
activation-rounding bound of the same file dequantized (int16 activations).

transformers 5 saves the layer types as "linear_attention" / "full_attention", which the
converter reads as all Mamba (its KV head counts all 0); the loader then finds the attention
layers by their tensors. The converter writes no RoPE for hybrids, so the models here are NoPE,
as IBM's Granite 4 hybrids are.
"""
from __future__ import annotations


import pytest

from kvserve.model.config import ModelConfig
from helpers.tiny_models import GRANITE_HYBRID_BOUND, tiny_granite_hybrid_config
from hybrid_gguf_checks import (assert_float32_gguf_matches, assert_generate_answers, assert_held_within_activation_rounding,
                                clear_sequences, gguf_getter)

pytest.importorskip("gguf")

# |our logit - transformers' logit| <= MAX_RELATIVE_DIFF * max(1, max |transformers' logit|):
# derived next to GRANITE_HYBRID_BOUND for these tiny models in float32 (49 reduction stages).
# The file's float32 values are the checkpoint's except A = -exp(A_log), whose log (taken in
# float64, rounded once) gives back A_log within an ulp, so exp(A_log) moves by 2**-23 relative,
# and the residual multiplier stored as float32 (0.7 -> 0.7 (1 - 1.7e-8)): each one more rounding
# beside the 49 stages' 7.6e-6 each, well inside the bound's slack.
MAX_RELATIVE_DIFF = GRANITE_HYBRID_BOUND
VARIANTS = ["moe", "dense"]


def _hf_config(variant: str, vocab_size: int):
    return tiny_granite_hybrid_config(vocab_size, experts=variant == "moe")


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """A getter (variant, outtype) -> (transformers' float32 model, its directory, the GGUF path)."""
    return gguf_getter(tmp_path_factory, _hf_config)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gguf_config_equals_the_hf_directory_config(gguf_files, variant):
    """Every field the hybrid decoder reads, from the GGUF keys (ssm.*, the multipliers, the
    experts' and shared expert's sizes, the attention layers) as from config.json. Not compared:
    the context length (the converter writes 2**20 for NoPE hybrids) and the special tokens
    (the GGUF's come from the tokenizer)."""
    _, directory, path = gguf_files(variant)
    ours, theirs = ModelConfig.from_path(path), ModelConfig.from_path(directory)
    fields = ("architecture", "family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "layer_types", "rope", "use_rope", "mamba", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "intermediate_size", "sparse_layers", "softmax_after_topk",
              "shared_expert_size", "tie_word_embeddings", "embedding_multiplier", "logits_scaling",
              "attention_multiplier")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.layer_types == ["mamba", "full", "mamba", "mamba"]
    for field in ("rms_norm_eps", "residual_multiplier"):  # stored as float32
        assert getattr(ours, field) == pytest.approx(getattr(theirs, field), rel=2 ** -23)


def _sequences(hf, seed: int) -> dict[str, list[int]]:
    return clear_sequences(hf, seed, MAX_RELATIVE_DIFF, hf.config.num_local_experts)


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_gguf_matches_transformers_under_teacher_forcing(gguf_files, variant):
    """The F32 file on a hybrid paged cache (blocks of 4, prefill chunks of 7 beside one-token
    steps, state snapshots inside chunks) against transformers on the source model: every row
    of logits within MAX_RELATIVE_DIFF."""
    hf, _, path = gguf_files(variant)
    assert_float32_gguf_matches(hf, path, _sequences(hf, seed=5), MAX_RELATIVE_DIFF)


def test_q8_0_gguf_held_as_stored_within_activation_rounding(gguf_files):
    """The Q8_0 file with its projections (Mamba-2's, attention's, routed and shared experts')
    held as the file's blocks, every step through the integer kernel (no panel or dense-GEMM
    paths, whose rounding is another), against the same file dequantized to float32, fed the
    same tokens: within the bound that rounding every quantized matmul's activations gives
    (hybrid_gguf_checks.py). With int16 activations, as for the Gated DeltaNet hybrids
    (test_gated_deltanet_gguf.py): the SSM's gates amplify their inputs' rounding."""
    from helpers.kernel_switches import env_kernels
    from kvserve.model import quantized
    kernels = env_kernels(quant_gemm_rows=0, quant_panel_rows=0, quant_act_bits=16)
    if quantized.kernel_isa(kernels) is None:
        pytest.skip("no native kernels")
    hf, _, path = gguf_files("moe", "q8_0")
    sequences = dict(list(_sequences(hf, seed=7).items())[:3])
    weights = assert_held_within_activation_rounding(path, kernels, sequences)
    # (the shared down projection, 48 columns, is no whole number of Q8_0 blocks: the converter writes it F16)
    assert {"layers.0.mamba.in_proj", "layers.1.self_attn.qkv_proj", "layers.0.shared_mlp.gate_up_proj"} <= set(weights)


def test_kvserve_generate_answers_from_the_gguf(gguf_files):
    """`kvserve generate --model granite.gguf` in float32, prefix caching on (the default), its
    tokenizer built from the file's keys: each token it picks is transformers' argmax on the same
    sequence (teacher forced), or within the bound of it (a near-tie either may break its way)."""
    hf, directory, path = gguf_files("moe")
    assert_generate_answers(hf, directory, path, MAX_RELATIVE_DIFF)
