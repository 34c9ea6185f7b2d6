"""Every `kvserve bench` sub-command, run through the CLI in a tiny configuration (seconds each)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers

from kvserve.bench.profile import NATIVE_DECODER, format_result
from kvserve.cli import main

from .fake_openai_server import FakeServer

ENGINE_FLAGS = ["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama saved like a Hugging Face checkpoint, with the default model's tokenizer."""
    from kvserve.engine.model_path import default_model_path
    from kvserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    path = tmp_path_factory.mktemp("bench_tiny_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def run_bench(tmp_path, capsys, *argv: str) -> dict:
    out_json = tmp_path / f"{argv[0]}.json"
    exit_code = main(["bench", *argv, "--output-json", str(out_json)])
    printed = capsys.readouterr().out
    assert exit_code == 0, printed
    assert str(out_json) in printed
    payload = json.loads(out_json.read_text())
    assert payload["benchmark"] == argv[0] and "timestamp_utc" in payload["environment"]
    return payload["result"]


def test_roofline_tiny(tmp_path, capsys):
    result = run_bench(tmp_path, capsys, "roofline", "--tiny", "--repeats", "1", "--bandwidth-mib", "4",
                       "--batch-sizes", "1,4")
    assert set(result["by_dtype"]) == {"float32", "bfloat16"}
    assert result["read_bandwidth_gb_per_s"] > 0
    assert (tmp_path / "roofline.png").stat().st_size > 0


def test_serve_against_a_fake_server(tmp_path, capsys):
    with FakeServer(num_tokens=4, first_token_delay_s=0.01, inter_token_delay_s=0.002) as server:
        result = run_bench(tmp_path, capsys, "serve", "--base-url", server.url, "--num-prompts", "6",
                           "--prompt-words", "5", "--max-tokens", "4", "--concurrency", "3")
    assert result["completed"] == 6 and result["output_tokens"] == server.log.tokens_sent == 24
    assert server.log.max_open_streams <= 3


def test_throughput_tiny_with_roofline_ceilings(tmp_path, capsys, tiny_model_dir):
    roofline = run_bench(tmp_path, capsys, "roofline", "--model", tiny_model_dir, "--repeats", "1",
                         "--bandwidth-mib", "4", "--batch-sizes", "1,4", "--dtypes", "float32", "--no-plot")
    assert roofline["model_shapes"]["hidden_size"] == 64
    result = run_bench(tmp_path, capsys, "throughput", "--model", tiny_model_dir, "--workloads", "fixed,mixed",
                       "--num-prompts", "3", "--prompt-len", "8", "--output-len", "4", "--max-prompt-len", "24",
                       "--max-output-len", "6", "--roofline-json", str(tmp_path / "roofline.json"), *ENGINE_FLAGS)
    batched_ceiling = roofline["by_dtype"]["float32"]["batched_ceiling_tokens_per_s"]
    assert result["ceilings"]["batched_tokens_per_s"] == batched_ceiling
    for run in result["results"]:
        tokens_per_s = (run["prompt_tokens"] + run["output_tokens"]) / run["elapsed_s"]
        assert run["share_of_batched_ceiling"] == pytest.approx(tokens_per_s / batched_ceiling)
    by_workload = {r["workload"]: r for r in result["results"]}
    for summary in result["workloads"]:
        measured = by_workload[summary["name"]]
        assert measured["output_tokens"] == summary["output_tokens"]
        assert measured["output_tokens_per_s"] == pytest.approx(measured["output_tokens"] / measured["elapsed_s"])
    assert by_workload["fixed"]["output_tokens"] == 12


def test_compare_tiny_against_transformers(tmp_path, monkeypatch, capsys, tiny_model_dir):
    monkeypatch.chdir(tmp_path)  # the run names its own JSON under bench_results/
    argv = ["bench", "compare", "--model", tiny_model_dir, "--workloads", "ragged,prefill", "--num-prompts", "3",
            "--prefill-len", "12", "--references", "transformers,llama.cpp", "--hf-batch-size", "2",
            "--no-warmup", "--rounds", "2", "--no-generate-rss", "--no-plot", *ENGINE_FLAGS]
    assert main(argv) == 0
    (written,) = (tmp_path / "bench_results").glob("compare-ragged-prefill-*.json")
    assert str(written.relative_to(tmp_path)) in capsys.readouterr().out
    result = json.loads(written.read_text())["result"]
    runs = {(r["engine"], r["workload"]): r for r in result["results"]}
    assert {engine for engine, _ in runs} == {"kvserve", "transformers"}
    # Each engine ran in its own child process, at the parent's torch thread count.
    for facts in result["engines"].values():
        assert facts["num_threads"] == torch.get_num_threads() and facts["peak_rss_mib"] > 0
    for workload in ("ragged", "prefill"):
        kv, hf = runs["kvserve", workload], runs["transformers", workload]
        assert len(kv["rounds_elapsed_s"]) == len(hf["rounds_elapsed_s"]) == 2
        (ratio,) = [r for r in result["ratios"] if r["workload"] == workload]
        per_round = [h / k for k, h in zip(kv["rounds_elapsed_s"], hf["rounds_elapsed_s"])]
        assert ratio["round_speedups"] == pytest.approx(per_round)
        assert ratio["speedup"] == pytest.approx(sum(per_round) / 2)  # median of two rounds
    assert runs["kvserve", "ragged"]["num_requests"] == 3
    assert runs["kvserve", "prefill"]["prompt_tokens"] == 12 and runs["kvserve", "prefill"]["output_tokens"] == 1
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama.cpp" in result["skipped"]


def test_prefix_tiny_hits_full_and_partial_blocks(tmp_path, capsys, tiny_model_dir):
    prefix_len, question_len, block_size, hash_size = 40, 4, 16, 4
    result = run_bench(tmp_path, capsys, "prefix", "--model", tiny_model_dir, "--num-requests", "3",
                       "--prefix-len", str(prefix_len), "--question-len", str(question_len), "--output-len", "2",
                       "--block-size", str(block_size), "--partial-hash-block-size", str(hash_size), *ENGINE_FLAGS)
    off, full_blocks, partial = result["configurations"]
    prompt_len = prefix_len + question_len
    assert off["cached_tokens_per_request"] == 0 and off["prefill_tokens_computed"] == 2 * prompt_len
    # Full-block hashing reuses whole blocks of the shared prefix; finer hashing reaches its end.
    assert full_blocks["cached_tokens_per_request"] == prefix_len // block_size * block_size
    assert partial["cached_tokens_per_request"] == prefix_len // hash_size * hash_size
    assert partial["prefill_tokens_computed"] == 2 * (prompt_len - prefix_len)


def test_profile_tiny(tmp_path, capsys, tiny_model_dir):
    result = run_bench(tmp_path, capsys, "profile", "--model", tiny_model_dir, "--batch-size", "2",
                       "--context-len", "8", "--steps", "2", *ENGINE_FLAGS)
    shares = {c["category"]: c["share"] for c in result["categories"]}
    assert sum(shares.values()) == pytest.approx(1.0)
    # The tiny float32 model's steps run whole in the native decoder (LM head included).
    assert shares[NATIVE_DECODER] > 0 and shares["worker: input preparation / output"] > 0
    assert result["plain_step_ms"] > 0 and result["top_functions_model_step"]
    split = result["native_split"]  # inside the call, by phase (csrc/decoder/phase_timer.h)
    assert split["calls"] >= 1 and split["threads"][0]["QKV matmul"] > 0
    assert result["fewer_barriers_ab"] is None  # not asked for


def test_profile_ab_of_the_fewer_barriers(tmp_path, capsys, tiny_model_dir):
    """`--ab-fewer-barriers`: alternating rounds with the native call's fewer barriers a layer
    and without, each round's step times, ratios and phases recorded."""
    result = run_bench(tmp_path, capsys, "profile", "--model", tiny_model_dir, "--batch-size", "1",
                       "--context-len", "8", "--steps", "2", "--ab-fewer-barriers", "3", *ENGINE_FLAGS)
    ab = result["fewer_barriers_ab"]
    assert ab["rounds"] == 3 and len(ab["step_ms"]["on"]) == len(ab["step_ms"]["off"]) == 3
    assert ab["median_ratio"] == pytest.approx(sorted(ab["ratios_off_over_on"])[1])
    assert all(phases[0]["QKV matmul"] > 0 for phases in ab["median_phases_ms_per_call"].values())
    assert "fewer barriers a layer vs more" in format_result(result)


def test_host_tiny(tmp_path, capsys, tiny_model_dir):
    result = run_bench(tmp_path, capsys, "host", "--model", tiny_model_dir, "--rounds", "2", "--prompt-len", "8",
                       "--output-len", "6", "--modes", "auto,sync,async", "--no-plot", *ENGINE_FLAGS)
    assert result["modes"] == ["auto", "sync", "async"]
    for mode in result["modes"]:
        rounds = result["rounds_by_mode"][mode]
        assert len(rounds) == 2 and all(r["tokens"] == 6 for r in rounds)
        # Every step (the prompt's and five decode steps) ran the native call, and the
        # host's pieces were timed without it.
        assert all(r["native_calls"] == r["steps"] == 6 for r in rounds)
        summary = result["summary"][mode]
        pieces = summary["pieces_ms_per_call"]
        assert 0 < pieces["  model forward"] < pieces["runner step"]
        assert summary["host_ms_per_step"] > 0 and summary["native_ms_per_call"] > 0
    assert result["summary"]["auto"]["speed_vs_first"] == 1.0


def test_scheduler_tiny(tmp_path, capsys):
    result = run_bench(tmp_path, capsys, "scheduler", "--num-running", "4,8", "--prompt-len", "32",
                       "--output-len", "8", "--no-plot")
    assert [entry["num_running"] for entry in result["kvserve"].values()] == [4, 8]
    assert all(entry["us_per_step"] > 0 for entry in result["kvserve"].values())


def test_kv_tiny(tmp_path, capsys):
    result = run_bench(tmp_path, capsys, "kv", "--num-requests", "100", "--no-plot")
    assert result["trace"]["num_requests"] == 100
    assert result["allocate_free"]["requests_per_s"] > 0 and result["prefix_hit"]["hit_rate"] > 0



def test_kvserve_runner_rounds_compute_their_prompts_again(tiny_model_dir):
    """A repeated workload must not be served from the prefix cache of the previous round."""
    from kvserve.bench.throughput import KvserveRunner
    from kvserve.bench.workloads import fixed_workload

    runner = KvserveRunner(model=tiny_model_dir, block_size=4, dtype="float32", kv_cache_memory="32MiB",
                           max_model_len=256)
    try:
        workload = fixed_workload(2, 12, 2, vocab_size=runner.vocab_size, seed=3)
        assert runner.run(workload).cached_prompt_tokens == 0
        # The control: without the reset, the same prompts hit the cache (whole blocks of 4).
        assert [output.num_cached_tokens for output in runner.generate(workload)] == [8, 8]
        assert runner.run(workload).cached_prompt_tokens == 0
    finally:
        runner.shutdown()
