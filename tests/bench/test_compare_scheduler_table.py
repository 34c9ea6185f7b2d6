"""`kvserve bench compare` prints the vLLM scheduler comparison it ran, and nothing without one."""
from kvserve.bench import compare
from kvserve.bench import scheduler as scheduler_bench


def _result(scheduler_comparison):
    return {"dtype": "float32", "results": [], "ratios": [], "skipped": {},
            "scheduler_comparison": scheduler_comparison}


def test_scheduler_rows_follow_the_measured_steps():
    comparison = scheduler_bench.run(num_running=(4,), prompt_len=40, output_len=12, num_timed_steps=3,
                                     compare_vllm=False)
    assert compare._format_scheduler_comparison(comparison) == ""
    # Pair the real kvserve measurement with itself as a stand-in "vLLM" side:
    # the printed ratio must then be exactly 1.
    comparison["vllm"] = dict(comparison["kvserve"])
    comparison["ratio_kvserve_over_vllm"] = {"4": 1.0}
    text = compare.format_result(_result(comparison))
    assert "scheduler step against vLLM" in text
    row = next(line for line in text.splitlines() if line.startswith("4 "))
    assert row.split()[-1] == "1.00x"
    assert str(round(comparison["kvserve"]["4"]["us_per_step"])) in row


def test_vllm_error_entry_is_shown_instead_of_a_ratio():
    comparison = scheduler_bench.run(num_running=(4,), prompt_len=40, output_len=12, num_timed_steps=3,
                                     compare_vllm=False)
    comparison["vllm"] = {"4": {"error": "ImportError: no vllm._C"}}
    comparison["ratio_kvserve_over_vllm"] = {}
    assert "ImportError: no vllm._C" in compare.format_result(_result(comparison))
    assert compare.format_result(_result(None)).count("vLLM") == 0
