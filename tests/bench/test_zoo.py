"""The model zoo: names, the random-weight GGUF files it writes, and `--model zoo:...` in the bench CLI.

The tiny shapes are written in the types the gguf package quantizes; the llama-quantize part runs
only where llama-quantize is already built (CI never builds llama.cpp)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvserve.bench import zoo
from kvserve.bench.llama_build import find_tool
from kvserve.cli import main
from kvserve.model.gguf_file import GGUFFile
from kvserve.model.gguf_loader import read_gguf_hf_config

gguf = pytest.importorskip("gguf")


@pytest.fixture
def zoo_cache(tmp_path, monkeypatch):
    """A fresh zoo directory (the rest of the cache, compiled kernels included, stays shared)."""
    directory = tmp_path / "zoo"
    monkeypatch.setattr(zoo, "zoo_dir", lambda: str(directory))
    return directory


def test_zoo_names_parse_and_bad_names_say_what_exists():
    assert zoo.parse_zoo_name("zoo:llama-1b-q4_k_m") == zoo.ZooModel("llama-1b", "q4_k_m")
    assert zoo.parse_zoo_name("qwen-0.5b-IQ4_XS") == zoo.ZooModel("qwen-0.5b", "iq4_xs")
    assert zoo.is_zoo_name("zoo:x") and not zoo.is_zoo_name("/models/x.gguf") and not zoo.is_zoo_name(None)
    with pytest.raises(zoo.ZooError, match="shapes are llama-1b"):
        zoo.parse_zoo_name("zoo:llama-2b-q4_0")
    with pytest.raises(zoo.ZooError, match="types are q4_k_m"):
        zoo.parse_zoo_name("zoo:llama-1b-q3_k_xl")
    with pytest.raises(zoo.ZooError, match="does not quantize q4_k_m"):
        zoo.build_zoo_model(zoo.parse_zoo_name("tiny-llama-q4_k_m"), quantizer="gguf")


def test_full_shapes_count_the_parameters_of_the_models_they_copy():
    # Published sizes: Llama-3.2-1B 1.24B, Qwen2.5-0.5B 0.49B, Gemma-2-2B 2.61B (tied embeddings).
    assert round(zoo.SHAPES["llama-1b"].num_parameters() / 1e9, 2) == 1.24
    assert round(zoo.SHAPES["qwen-0.5b"].num_parameters() / 1e9, 2) == 0.49
    assert round(zoo.SHAPES["gemma-2b"].num_parameters() / 1e9, 2) == 2.61
    # Qwen3-30B-A3B (30.5B total, 3.3B active) has 48 of these layers, the zoo shape 24: its
    # 128 experts of width 768 x 3 matrices x 2048 are 0.60B a layer (14.5B on 24 layers),
    # plus attention 0.45B and untied embeddings 0.62B; a token reads 8 experts (0.91B), the
    # attention and the LM head (0.31B).
    moe = zoo.SHAPES["qwen3moe-15b-a2b"]
    assert round(moe.num_parameters() / 1e9, 1) == 15.6 and round(moe.matmul_params / 1e9, 2) == 1.68


def test_not_built_without_permission(zoo_cache):
    with pytest.raises(zoo.ZooError, match="not built yet"):
        zoo.resolve_zoo_model("zoo:tiny-llama-q8_0", build=False)


@pytest.mark.parametrize("name", ["tiny-qwen-q8_0", "tiny-llama-q4_0", "tiny-qwen3moe-q8_0"])
def test_tiny_zoo_file_has_the_shape_tokenizer_and_types(zoo_cache, name):
    path = zoo.resolve_zoo_model(f"zoo:{name}")
    assert path.startswith(str(zoo_cache)) and zoo.resolve_zoo_model(f"zoo:{name}", build=False) == path
    model = zoo.parse_zoo_name(name)
    shape = model.shape
    hf, overrides = read_gguf_hf_config(path)
    assert hf["model_type"] == shape.architecture and hf["hidden_size"] == shape.hidden_size
    assert (hf["num_attention_heads"], hf["num_key_value_heads"]) == (shape.num_heads, shape.num_kv_heads)
    assert hf["vocab_size"] == shape.vocab_size and hf["attention_bias"] == shape.qkv_bias
    assert hf["tie_word_embeddings"] and overrides["bos_token_id"] == 1
    reader = GGUFFile(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    down = "blk.0.ffn_down_exps.weight" if shape.num_experts else "blk.0.ffn_down.weight"
    assert types[down] == model.type_name.upper() and types["output_norm.weight"] == "F32"
    if shape.num_experts:  # stacked experts, the router in float32, as llama.cpp's converter writes them
        assert (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == \
            (shape.num_experts, shape.experts_per_token, shape.expert_width)
        exps = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate_exps.weight")
        assert tuple(exps.shape) == (shape.hidden_size, shape.expert_width, shape.num_experts)
        assert types["blk.1.ffn_gate_inp.weight"] == "F32"
    assert ("blk.1.attn_k.bias" in types) == shape.qkv_bias
    assert len(types) == len(list(zoo._tensor_specs(shape)))
    tokens = reader.get("tokenizer.ggml.tokens")
    assert len(tokens) == shape.vocab_size and len(set(tokens)) == len(tokens)


def test_padded_vocabulary_is_normal_tokens_after_the_shipped_ones(zoo_cache):
    shape = zoo.ZooShape(256, 512, 1, 4, 2, 64, vocab_size=49152 + 5)
    path = zoo.write_random_gguf(shape, str(zoo_cache / "padded.gguf"), "q8_0")
    reader = GGUFFile(path)
    tokens, token_types = reader.get("tokenizer.ggml.tokens"), reader.get("tokenizer.ggml.token_type")
    assert tokens[-5:] == [f"[zoo-pad-{i}]" for i in range(5)]
    assert token_types[-5:] == [int(gguf.TokenType.NORMAL)] * 5
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    values = gguf.quants.dequantize(np.asarray(embedding.data), embedding.tensor_type)
    assert values.shape == (49157, 256)
    # Rows are normals of scale 1/sqrt(256): the sample deviation of 1.26M values is within 1%.
    assert abs(values.std() - 1 / 16) < 0.01 / 16


def test_bench_cli_resolves_a_zoo_model(zoo_cache, tmp_path, capsys):
    out_json = tmp_path / "profile.json"
    exit_code = main(["bench", "profile", "--model", "zoo:tiny-qwen-q8_0", "--batch-size", "1",
                      "--context-len", "8", "--steps", "2", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
                      "--output-json", str(out_json), "--no-plot"])
    printed = capsys.readouterr().out
    assert exit_code == 0, printed
    assert f"zoo model zoo:tiny-qwen-q8_0: {zoo_cache}" in printed
    assert json.loads(out_json.read_text())["benchmark"] == "profile"


def test_bench_zoo_lists_and_builds(zoo_cache, capsys):
    assert main(["bench", "zoo", "tiny-llama-q8_0"]) == 0
    assert "zoo:tiny-llama-q8_0" in capsys.readouterr().out
    assert main(["bench", "zoo"]) == 0
    listing = capsys.readouterr().out
    assert "Llama-3.2-1B" in listing and "cached: q8_0" in listing
    assert main(["bench", "zoo", "tiny-llama-q4_k_x"]) == 1
    assert "unknown quantization type" in capsys.readouterr().err


def test_llama_cpp_runs_the_moe_zoo_file(zoo_cache):
    """llama.cpp (llama-cpp-python) reads the tiny Qwen3-MoE zoo file as a qwen3moe with its experts."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = zoo.resolve_zoo_model("zoo:tiny-qwen3moe-q8_0")
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=1, verbose=False)
    try:
        assert llm.metadata["general.architecture"] == "qwen3moe" and llm.metadata["qwen3moe.expert_count"] == "8"
        assert len(llm.tokenize(b"Hello")) > 0 and len(llm("Hello", max_tokens=3, temperature=0.0)["choices"]) == 1
    finally:
        llm.close()


@pytest.mark.skipif(find_tool("llama-quantize") is None,
                    reason="llama-quantize is not built (python3 -m kvserve.bench.llama_build llama-quantize "
                           "builds it in 10+ minutes; CI does not)")
def test_llama_quantize_makes_a_q4_k_m_mixture_kvserve_runs(zoo_cache):
    from kvserve import LLM, SamplingParams

    path = zoo.resolve_zoo_model("zoo:tiny-llama-q4_k_m")
    types = {t.tensor_type.name for t in GGUFFile(path).tensors}
    # Q4_K_M: Q4_K matrices, some (half the attn_v / ffn_down and the embedding) Q6_K.
    assert {"Q4_K", "Q6_K", "F32"} <= types
    llm = LLM(model=path, kv_cache_memory="16MiB", max_model_len=128)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_profile_ab_of_the_moe_split(zoo_cache, tmp_path, capsys):
    """`--ab-moe-split` on the tiny Qwen3-MoE: alternating rounds with the MoE layers' experts
    split over the threads whole and by rows, each round's step times, ratios and phases."""
    out_json = tmp_path / "profile.json"
    exit_code = main(["bench", "profile", "--model", "zoo:tiny-qwen3moe-q8_0", "--batch-size", "2",
                      "--context-len", "8", "--steps", "2", "--ab-moe-split", "3", "--kv-cache-memory", "16MiB",
                      "--max-model-len", "128", "--output-json", str(out_json), "--no-plot"])
    printed = capsys.readouterr().out
    assert exit_code == 0, printed
    ab = json.loads(out_json.read_text())["result"]["moe_split_ab"]
    assert ab["switch"] == "moe_split" and ab["rounds"] == 3
    assert len(ab["step_ms"]["experts"]) == len(ab["step_ms"]["rows"]) == 3
    assert ab["median_ratio"] == sorted(ab["ratios_rows_over_experts"])[1]
    assert all(phases[0]["gate/up matmul"] > 0 for phases in ab["median_phases_ms_per_call"].values())
    assert "MoE experts split over the threads whole vs by rows" in printed
