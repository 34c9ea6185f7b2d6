"""Pieces of `kvserve bench compare`: transformers at its best (continuous batching), the best-of
ratio, and the peak RSS of a `kvserve generate` child."""
from __future__ import annotations

import pytest

from kvserve.bench import compare
from kvserve.bench.engine_process import generate_peak_rss
from kvserve.bench.references import TransformersRunner
from kvserve.bench.workloads import ragged_workload

from .test_cli import tiny_model_dir  # noqa: F401  (fixture)


def test_transformers_continuous_batching_produces_each_requests_tokens(tiny_model_dir):  # noqa: F811
    workload = ragged_workload(3, 5, 12, 3, vocab_size=256, seed=1)
    result = TransformersRunner(tiny_model_dir, batch_size=2, strategy="continuous").run(workload)
    assert result.engine == "transformers-cb" and result.output_tokens == 9  # checked per request inside run


def _run(engine, times):
    return {"engine": engine, "workload": "w", "output_tokens": 10, "elapsed_s": sorted(times)[1],
            "output_tokens_per_s": 10 / sorted(times)[1], "rounds_elapsed_s": times}


def test_best_transformers_takes_the_faster_strategy_in_each_round():
    results = [_run("kvserve", [1.0, 1.0, 1.0]), _run("transformers", [2.0, 5.0, 3.0]),
               _run("transformers-cb", [4.0, 1.5, 3.5])]
    best = {r["reference"]: r for r in compare.ratios(results)}["transformers (best)"]
    assert best["round_speedups"] == [2.0, 1.5, 3.0]
    assert best["speedup"] == 2.0  # median of the per-round ratios, not a ratio of medians


@pytest.mark.slow
def test_generate_peak_rss_is_the_childs_own(tiny_model_dir):  # noqa: F811
    measured = generate_peak_rss(tiny_model_dir, ["--kv-cache-memory", "32MiB", "--max-model-len", "128"],
                                 max_tokens=2)
    assert measured["command"].startswith("kvserve generate") and 50 < measured["peak_rss_mib"] < 4096
    with pytest.raises(RuntimeError, match="kvserve generate failed"):
        generate_peak_rss(tiny_model_dir, ["--max-model-len", "not-a-number"], max_tokens=2)


def test_serve_compare_ratios_are_medians_of_rounds():
    from kvserve.bench import serve_compare

    def served(tok_s, tpot, ttft):
        return {"output_token_throughput": tok_s, "tpot": {"mean_ms": tpot, "p50_ms": tpot},
                "ttft": {"mean_ms": ttft, "p50_ms": ttft}, "failed": 0}
    runs = {"kvserve": [served(100, 10, 50), served(90, 12, 40), served(120, 8, 60)],
            "llama.cpp": [served(50, 20, 100), served(60, 12, 80), served(40, 16, 30)]}
    ratios = serve_compare._ratios(runs)
    assert ratios == {"output_tok_s": 2.0, "tpot_mean": 0.5, "ttft_mean": 0.5}
    assert serve_compare._summary(runs["kvserve"])["output_token_throughput"] == 100
    command = serve_compare.llama_cpp_command("m.gguf", 8, 2, 1024, llama_server="/opt/llama-server")
    assert command.argv[command.argv.index("--parallel") + 1] == "8" and "-t" in command.argv
