"""The memory-bandwidth bound in bench results (kvserve/bench/bandwidth_bound.py): the weight
bytes a decode step reads, counted against independent readers of the files (gguf-py, the
safetensors library), and each rate's bound and share of it in the CLI's JSON."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from kvserve.bench import bandwidth_bound
from kvserve.cli import main

from .fake_openai_server import FakeServer
from .test_cli import run_bench, tiny_model_dir  # noqa: F401 - the fixture


def _tiny_llama(tie: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [False, True], ids=["own_head", "tied"])
def test_gguf_weight_bytes_are_every_tensor_but_an_untied_embedding(tmp_path, tie):
    gguf = pytest.importorskip("gguf")
    from helpers.gguf_writer import write_gguf

    path = str(tmp_path / "tiny.gguf")
    write_gguf(_tiny_llama(tie), path, gguf.GGMLQuantizationType.Q8_0)
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    assert ("output.weight" in tensors) == (not tie)
    expected = sum(size for name, size in tensors.items() if tie or name != "token_embd.weight")
    counted = bandwidth_bound.weight_bytes_per_token(path)
    assert counted["bytes"] == expected and counted["tied_embeddings"] == tie


def test_safetensors_weight_bytes_and_experts_read_per_token(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = tmp_path / "hf"
    _tiny_llama(False).save_pretrained(str(directory), safe_serialization=True)
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        sizes = {name: f.get_tensor(name).numel() * f.get_tensor(name).element_size() for name in f.keys()}
    assert bandwidth_bound.weight_bytes_per_token(str(directory))["bytes"] == \
        sum(size for name, size in sizes.items() if not name.endswith("embed_tokens.weight"))
    # A mixture of experts routed to 2 of 8: a token reads a quarter of the expert weights.
    moe = tmp_path / "moe"
    moe.mkdir()
    expert = torch.zeros(16, 8)
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8), "lm_head.weight": torch.zeros(32, 8),
               **{f"model.layers.0.mlp.experts.{e}.down_proj.weight": expert.clone() for e in range(8)}},
              str(moe / "model.safetensors"))
    (moe / "config.json").write_text(json.dumps({"num_experts": 8, "num_experts_per_tok": 2}))
    counted = bandwidth_bound.weight_bytes_per_token(str(moe))
    assert counted["experts_used_share"] == 0.25
    assert counted["bytes"] == 32 * 8 * 4 + 8 * expert.numel() * 4 // 4


def test_every_rate_gets_its_bound_for_the_sequences_it_decoded(tmp_path, monkeypatch):
    monkeypatch.setattr(bandwidth_bound, "weight_bytes_per_token",
                        lambda path: {"bytes": 2_000_000_000, "tied_embeddings": False})
    roofline = tmp_path / "roofline.json"
    roofline.write_text(json.dumps({"result": {"read_bandwidth_gb_per_s": 40.0}}))
    result = {"results": [{"workload": "single", "num_requests": 1, "output_tokens_per_s": 15.0},
                          {"workload": "fixed", "num_requests": 8, "output_tokens_per_s": 100.0}],
              "servers": {"kvserve": {"rounds": [{"config": {"concurrency": 4}, "output_token_throughput": 30.0}]}}}
    bandwidth_bound.attach(result, "model.gguf", str(roofline))
    assert result["bandwidth_bound"]["single_sequence_tokens_per_s"] == pytest.approx(20.0)  # 40 GB/s / 2 GB
    single, fixed = result["results"]
    assert single["output_tokens_per_s_bound"] == pytest.approx(20.0)
    assert single["output_tokens_per_s_pct_of_bound"] == pytest.approx(75.0)
    assert fixed["bandwidth_bound_sequences"] == 8 and fixed["output_tokens_per_s_pct_of_bound"] == pytest.approx(62.5)
    served = result["servers"]["kvserve"]["rounds"][0]
    assert served["output_token_throughput_bound"] == pytest.approx(80.0)
    assert served["output_token_throughput_pct_of_bound"] == pytest.approx(37.5)
    skipped = bandwidth_bound.attach({"output_token_throughput": 1.0}, None)
    assert "skipped" in skipped["bandwidth_bound"] and "output_token_throughput_bound" not in skipped


def test_roofline_measures_the_bound_of_any_model_file(tmp_path, capsys, tiny_model_dir):  # noqa: F811
    gguf = pytest.importorskip("gguf")
    from helpers.gguf_writer import write_gguf

    path = str(tmp_path / "tiny-q4_0.gguf")
    write_gguf(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir), path,
               gguf.GGMLQuantizationType.Q4_0, tokenizer_model="no_vocab")
    for model in (tiny_model_dir, path):
        result = run_bench(tmp_path, capsys, "roofline", "--model", model, "--repeats", "1", "--bandwidth-mib", "4",
                           "--batch-sizes", "1", "--dtypes", "float32", "--no-plot")
        bound = result["model_file"]
        assert bound["model"] == model and result["model_shapes"]["hidden_size"] == 64
        assert bound["weight_bytes_per_token"] == bandwidth_bound.weight_bytes_per_token(model)["bytes"]
        assert bound["single_sequence_tokens_per_s"] == pytest.approx(
            result["read_bandwidth_gb_per_s"] * 1e9 / bound["weight_bytes_per_token"])


def test_throughput_and_serve_json_report_the_share_of_the_bound(tmp_path, capsys, tiny_model_dir):  # noqa: F811
    result = run_bench(tmp_path, capsys, "throughput", "--model", tiny_model_dir, "--workloads", "fixed",
                       "--num-prompts", "3", "--prompt-len", "8", "--output-len", "4", "--kv-cache-memory", "32MiB",
                       "--max-model-len", "256", "--dtype", "float32")
    per_sequence = result["bandwidth_bound"]["single_sequence_tokens_per_s"]
    (run,) = result["results"]
    assert run["bandwidth_bound_sequences"] == 3
    assert run["output_tokens_per_s_pct_of_bound"] == pytest.approx(100 * run["output_tokens_per_s"] / (3 * per_sequence))
    with FakeServer(num_tokens=4, first_token_delay_s=0.01, inter_token_delay_s=0.002) as server:
        served = run_bench(tmp_path, capsys, "serve", "--base-url", server.url, "--num-prompts", "4",
                           "--prompt-words", "5", "--max-tokens", "4", "--concurrency", "2", "--model", tiny_model_dir)
        assert served["output_token_throughput_pct_of_bound"] > 0 and served["bandwidth_bound_sequences"] == 2
        unbounded = run_bench(tmp_path, capsys, "serve", "--base-url", server.url, "--num-prompts", "2",
                              "--prompt-words", "5", "--max-tokens", "4", "--concurrency", "2")
    assert "skipped" in unbounded["bandwidth_bound"]
    assert main(["bench", "roofline", "--tiny", "--repeats", "1", "--bandwidth-mib", "4", "--batch-sizes", "1",
                 "--no-plot", "--output-json", str(tmp_path / "r.json")]) == 0
