"""ModelConfig parsing (HF directories, GGUF metadata, errors) and RoPE
frequencies against transformers' own implementations."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvserve.model.config import (ModelConfig, ModelConfigError, ModelFilesNotFoundError, RopeConfig,
                                  UnsupportedArchitectureError)
from kvserve.model.layers import RotaryEmbedding, rope_inv_freq
from paged_kv_helper import WINDOW, tiny_hf_config


def _save_config(hf_config, path) -> str:
    hf_config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[hf_config.model_type]]
    hf_config.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("family,expected_types,softcap,qk_norm,bias", [
    ("llama", ["full", "full"], None, False, False),
    ("mistral", ["sliding", "sliding"], None, False, False),
    ("qwen2", ["full", "full"], None, False, True),
    ("qwen3", ["full", "full"], None, True, False),
    ("gemma2", ["sliding", "full", "sliding", "full"], 30.0, False, False),
    ("gemma3", ["sliding", "sliding", "full", "sliding"], None, True, False),
])
def test_family_switches_from_config_json(tmp_path, family, expected_types, softcap, qk_norm, bias):
    hf = tiny_hf_config(family)
    config = ModelConfig.from_path(_save_config(hf, tmp_path))
    assert config.layer_types == expected_types
    assert config.sliding_window == (WINDOW if "sliding" in expected_types else None)
    assert config.final_logit_softcapping == softcap
    assert config.qk_norm == qk_norm
    assert config.attention_bias == bias
    assert config.num_kv_heads == hf.num_key_value_heads
    assert config.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert config.eos_token_ids == [2]
    assert config.max_model_len == hf.max_position_embeddings
    assert config.is_gemma == family.startswith("gemma")


def test_gemma3_local_rope_and_scalar(tmp_path):
    config = ModelConfig.from_path(_save_config(tiny_hf_config("gemma3"), tmp_path))
    assert config.rope == RopeConfig(theta=100000.0, rope_type="linear", factor=2.0)
    assert config.rope_local.theta == 10000.0
    assert config.rope_for_layer(0) is config.rope_local and config.rope_for_layer(2) is config.rope
    assert config.attention_scale == 16 ** -0.5


def test_transformers_4_layout_still_read():
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
          "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100,
          "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0},
          "eos_token_id": [5, 6], "max_position_embeddings": 1024}
    config = ModelConfig.from_hf_dict(hf, max_model_len=256)
    assert config.rope.theta == 500000.0 and config.rope.rope_type == "linear" and config.rope.factor == 4.0
    assert config.eos_token_ids == [5, 6]
    assert config.max_model_len == 256
    assert config.num_kv_heads == 4


def test_errors_are_clear(tmp_path):
    with pytest.raises(ModelFilesNotFoundError, match="does not exist"):
        ModelConfig.from_path(str(tmp_path / "nope"))
    with pytest.raises(ModelFilesNotFoundError, match="config.json"):
        ModelConfig.from_path(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(UnsupportedArchitectureError, match="BertModel.*supported"):
        ModelConfig.from_path(str(tmp_path))
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ModelFilesNotFoundError, match="gguf"):
        ModelConfig.from_path(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelConfigError, match="dtype"):
        ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "hidden_size": 8, "intermediate_size": 8,
                                  "vocab_size": 10}, dtype="int8")
    assert issubclass(UnsupportedArchitectureError, ValueError)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000000.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "beta_fast": 16.0, "beta_slow": 2.0},
])
def test_rope_frequencies_match_transformers(rope_parameters):
    max_pos = 131072
    hf = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=max_pos,
                                  rope_parameters=dict(rope_parameters))
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        head_dim = 128
        expected = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        expected_factor = 1.0
    else:
        expected, expected_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    config = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours, factor = rope_inv_freq(config.head_dim, config.rope, config.max_position_embeddings)
    assert torch.allclose(ours, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


def test_rope_cos_sin_come_from_a_table_that_grows_and_follows_the_frequencies():
    """Steps gather their cos/sin rows from a table: the values of the direct formula
    (transformers' cos(position * inv_freq) with both halves repeated), at positions past the
    first table's end too, and rebuilt when the frequencies change (GGUF rope_freqs)."""
    rotary = RotaryEmbedding(16, RopeConfig(theta=10000.0), 4096)

    def direct(positions):  # the angles in float32, as transformers computes them
        angles = (positions.float()[:, None] * rotary.inv_freq[None, :]).double()
        return torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), dim=-1).sin()

    for positions in (torch.tensor([0, 5, 255]), torch.tensor([3000, 7, 1024])):
        cos, sin = rotary.cos_sin(positions, torch.float32)
        assert cos.shape == (3, 1, 16)
        want_cos, want_sin = direct(positions)
        torch.testing.assert_close(cos[:, 0].double(), want_cos, rtol=0, atol=2e-6)
        torch.testing.assert_close(sin[:, 0].double(), want_sin, rtol=0, atol=2e-6)
        rows_cos, _ = rotary.cos_sin_rows(positions, int(positions.max()) + 1)
        assert rows_cos.is_contiguous() and torch.equal(rows_cos, cos[:, 0])
    rotary.set_freq_factors(torch.full((8,), 2.0))
    positions = torch.tensor([1, 100])
    torch.testing.assert_close(rotary.cos_sin(positions, torch.float32)[0][:, 0].double(), direct(positions)[0],
                               rtol=0, atol=2e-6)


def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path):
    text = tiny_hf_config("gemma3").to_dict()
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "text_config": text, "vision_config": {"hidden_size": 32}, "eos_token_id": [1, 106]}
    config = ModelConfig.from_hf_dict(hf)
    assert config.family == "gemma3" and config.architecture == "Gemma3ForCausalLM"
    assert config.layer_types == ["sliding", "sliding", "full", "sliding"]
    assert config.eos_token_ids == [2]  # the text config's own eos wins when it has one
