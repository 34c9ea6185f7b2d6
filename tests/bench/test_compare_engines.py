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


def _fake_spec(name: str, **kwargs) -> "compare.RunnerSpec":
    return compare.RunnerSpec(name, "kvserve.testing:FakeBenchRunner", {"engine": name, **kwargs})


def test_a_reference_that_crashes_is_recorded_with_its_signal_and_round_and_said():
    """A reference child killed by a signal (llama.cpp's AMX kernels do so on some CPUs) is neither
    skipped nor hidden: the result names the engine, the signal, the round, what was done, and
    its figures cover only the rounds it finished."""
    workloads = [ragged_workload(2, 3, 4, 2, vocab_size=64, seed=1)]
    first = compare._start(_fake_spec("kvserve"), 1, workloads, warmup=False)
    # llama.cpp crashes at load on its repacked buffers, then in its second run on plain ones.
    specs = [_fake_spec("llama.cpp", crash_signal="SIGSEGV", crash_on_load=True, crash_on_run=2)]
    results, facts, failures = compare._run_engines(first, specs, workloads, rounds=3, warmup=False, num_threads=1)
    assert failures == [
        {"engine": "llama.cpp", "phase": "loading", "round": None, "workload": None, "signal": "SIGSEGV",
         "exit_code": -11, "error": failures[0]["error"], "action": "retried on plain CPU buffers (extra_buffers=False)"},
        {"engine": "llama.cpp", "phase": "run", "round": 2, "workload": workloads[0].name, "signal": "SIGSEGV",
         "exit_code": -11, "error": failures[1]["error"], "action": "left out of the later rounds"},
    ]
    assert "killed by SIGSEGV" in failures[0]["error"]
    assert facts["llama.cpp"]["runner_kwargs"]["extra_buffers"] is False  # the fallback is in the facts too
    rounds_run = {r["engine"]: len(r["rounds_elapsed_s"]) for r in results}
    assert rounds_run == {"kvserve": 3, "llama.cpp": 1}
    text = compare.format_failures(failures)
    assert "REFERENCE FAILED: llama.cpp killed by SIGSEGV (round 2, workload" in text
    assert "REFERENCE FAILED: llama.cpp killed by SIGSEGV (loading)" in text
