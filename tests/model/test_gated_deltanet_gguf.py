"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE from GGUF (#29): tiny random models (tests/helpers/
tiny_models.py) converted by llama.cpp's own convert_hf_to_gguf.py (llama-cpp-python 0.3.36's
sdist, which defines qwen3next, qwen35 and qwen35moe) to F32 and Q8_0, loaded by kvserve:
the config read from the GGUF keys equals the one read from the HF directory; the F32 file
matches transformers in float32 under teacher forcing; the Q8_0 file's weights held as
stored hold the same file's values dequantized and run within the activation-rounding bound of it (int16 activations); `kvserve
generate --model x.gguf` answers (prefix caching on, the default); and a file whose
linear-attention metadata is incomplete is refused in one line.

llama.cpp's qwen3next has no dense layers beside sparse ones (its converter cannot map
`mlp_only_layers`' MLP), so the Qwen3-Next model here is sparse on every layer.
"""
from __future__ import annotations


import pytest

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.tiny_models import GATED_DELTANET_FAMILIES, tiny_gated_deltanet_config
from hybrid_gguf_checks import (assert_float32_gguf_matches, assert_generate_answers, assert_held_within_activation_rounding,
                                clear_sequences, gguf_getter, kvserve_generate)
from paged_kv_helper import held_weights

pytest.importorskip("gguf")

# |our logit - transformers' logit| <= MAX_RELATIVE_DIFF * max(1, max |transformers' logit|):
# tests/model/test_gated_deltanet_models.py derives 5e-4 for these tiny models in float32 (33
# reduction stages of at most 128 terms, the chunked delta rule's solve amplifying its
# rounding at most twofold). The file's float32 values are the checkpoint's except
# A = -exp(A_log): its log (taken in float64, rounded once) gives back A_log within an ulp, so
# exp(A_log) moves by 2**-23 relative, one more rounding of the decay among the 33 stages'
# thousands of ulps: the same bound holds.
MAX_RELATIVE_DIFF = 5e-4


def _hf_config(family: str, vocab_size: int):
    config = tiny_gated_deltanet_config(family, vocab_size)
    if family == "qwen3_next":
        config.mlp_only_layers = []
    return config


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """A getter (family, outtype) -> (transformers' float32 model, its directory, the GGUF path)."""
    return gguf_getter(tmp_path_factory, _hf_config, extra_args=("--no-mtp",))


@pytest.mark.parametrize("family", GATED_DELTANET_FAMILIES)
def test_gguf_config_equals_the_hf_directory_config(gguf_files, family):
    """Every field the hybrid decoder reads, from the GGUF keys (ssm.*, recurrent_layers,
    rope.dimension_count, the experts' and shared expert's) as from config.json."""
    _, directory, path = gguf_files(family)
    ours, theirs = ModelConfig.from_path(path), ModelConfig.from_path(directory)
    fields = ("architecture", "family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size", "layer_types", "rope", "qk_norm", "attn_output_gate", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "sparse_layers", "norm_topk_prob",
              "shared_expert_intermediate_size", "tie_word_embeddings", "max_position_embeddings")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.layer_types == ["linear_attention"] * 3 + ["full"]
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=2 ** -23)  # stored as float32


def _sequences(hf, seed: int) -> dict[str, list[int]]:
    return clear_sequences(hf, seed, MAX_RELATIVE_DIFF, getattr(hf.config, "num_experts", 0))


@pytest.mark.parametrize("family", GATED_DELTANET_FAMILIES)
def test_float32_gguf_matches_transformers_under_teacher_forcing(gguf_files, family):
    """The F32 file on a hybrid paged cache (blocks of 4, prefill chunks of 7 beside one-token
    steps, state snapshots inside chunks) against transformers on the source model: every row
    of logits within MAX_RELATIVE_DIFF."""
    hf, _, path = gguf_files(family)
    assert_float32_gguf_matches(hf, path, _sequences(hf, seed=5), MAX_RELATIVE_DIFF)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_q8_0_gguf_projections_held_as_the_files_blocks(gguf_files, family):
    """The Q8_0 file with quantization "auto": every projection (the Gated DeltaNet's q, k, v,
    z, b, a parts included, value heads moved back whole) is held as the file's Q8_0 blocks,
    each holding exactly the values of the same file dequantized to float32 (`held_weights`);
    the dequantizing load is the one the F32 test checks against transformers."""
    hf, _, path = gguf_files(family, "q8_0")
    held = load_model(ModelConfig.from_path(path))
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    weights = held_weights(held, plain)
    for layer in range(3):
        assert f"layers.{layer}.linear_attn.in_proj_qkvz" in weights and f"layers.{layer}.linear_attn.in_proj_ba" in weights
    assert "layers.3.self_attn.qkv_proj" in weights and "layers.3.self_attn.o_proj" in weights
    if family == "qwen3_next":  # value heads not tiled: out_proj stays the file's blocks too
        assert "layers.0.linear_attn.out_proj" in weights and "layers.0.mlp.shared_expert.gate_up_proj" in weights


def test_kvserve_generate_answers_from_the_gguf(gguf_files):
    """`kvserve generate --model qwen35.gguf` in float32, prefix caching on (the default): each
    token it picks is transformers' argmax on the same sequence (teacher forced), or within the
    bound of it (a near-tie either may break its way)."""
    hf, directory, path = gguf_files("qwen3_5")
    assert_generate_answers(hf, directory, path, MAX_RELATIVE_DIFF)


def test_incomplete_hybrid_metadata_is_refused_in_one_line(gguf_files, tmp_path):
    """A qwen35 file without `ssm.state_size` (its key renamed in place): `kvserve generate`
    exits non-zero with one line naming the missing key, and no traceback."""
    _, _, path = gguf_files("qwen3_5")
    with open(path, "rb") as f:
        data = f.read()
    key = b"qwen35.ssm.state_size"
    assert data.count(key) == 1
    broken = tmp_path / "incomplete.gguf"
    broken.write_bytes(data.replace(key, b"qwen35.ssm.state_sizX"))
    result = kvserve_generate(str(broken), "hello")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "qwen35.ssm.state_size" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_q8_0_gguf_held_as_stored_within_activation_rounding(gguf_files, family):
    """The Q8_0 file with its projections held as the file's blocks, every step through the
    integer kernel (no panel or dense-GEMM paths, whose rounding is another), against the same
    file dequantized to float32, fed the same tokens: within the bound that rounding every
    quantized matmul's activations gives (tests/helpers/activation_rounding.py), a bound that
    still tells wrong weights apart. With int16 activations: the same derivation for int8 gives
    a bound near a fifth of the logits' range on these tiny random hybrids (the decay and beta
    gates amplify their inputs' rounding), too loose to tell wrong weights apart."""
    from helpers.kernel_switches import env_kernels
    from kvserve.model import quantized
    kernels = env_kernels(quant_gemm_rows=0, quant_panel_rows=0, quant_act_bits=16)
    if quantized.kernel_isa(kernels) is None:
        pytest.skip("no native kernels")
    hf, _, path = gguf_files(family, "q8_0")
    assert_held_within_activation_rounding(path, kernels, dict(list(_sequences(hf, seed=7).items())[:3]))
