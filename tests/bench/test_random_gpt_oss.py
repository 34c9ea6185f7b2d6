"""kvserve.bench.random_gpt_oss: the gpt-oss-shaped random GGUF the gpt-oss A/B timings run on,
made by llama.cpp's converter (skipped where its sdist is not at hand), small here: kvserve
reads it as gpt-oss (sinks, sliding and full layers, YaRN, biased clamped-SwiGLU experts held as
the file's MXFP4 blocks) and its native decoder takes it."""
from __future__ import annotations

import pytest

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.model.native_decoder import NativeDecoder
from kvserve.native import cpu_kernels


def test_writes_a_gpt_oss_gguf_the_native_decoder_takes(tmp_path):
    pytest.importorskip("gguf")
    from kvserve.bench import random_gpt_oss
    from kvserve.bench.llama_build import LlamaBuildError, converter_script
    try:
        converter_script()
    except LlamaBuildError as exc:
        pytest.skip(f"llama.cpp's converter is not available: {exc}")
    path = str(tmp_path / "gpt-oss.gguf")
    assert random_gpt_oss.main(["--output", path, "--hidden", "256", "--num-layers", "2", "--num-experts", "4"]) == 0
    config = ModelConfig.from_path(path)
    assert config.family == "gpt_oss" and config.layer_types == ["sliding", "full"] and config.sliding_window == 128
    assert config.attention_sinks and config.softmax_after_topk and config.expert_bias and config.rope.rope_type == "yarn"
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 4, 256)
    model = load_model(config)
    parts = model.layers[0].mlp.experts[0].gate_up_proj.quant_weight.parts
    assert {part.type_name for part in parts} == {"MXFP4"}
    if cpu_kernels.load_library() is not None:
        assert NativeDecoder.for_model(model) is not None


def test_rejects_a_hidden_size_heads_do_not_divide(capsys):
    from kvserve.bench import random_gpt_oss
    assert random_gpt_oss.main(["--output", "x.gguf", "--hidden", "1000"]) == 2
    assert "multiple of 256" in capsys.readouterr().err
