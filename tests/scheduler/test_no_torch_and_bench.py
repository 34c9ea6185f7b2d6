"""The scheduler imports without torch, and its benchmark still runs."""
import json
import subprocess
import sys

from kvserve.bench import scheduler as scheduler_bench


def test_scheduler_and_testing_import_without_torch():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import kvserve.scheduler.scheduler, kvserve.testing\n"
        "from kvserve.testing import FakeModelRunner, StepDriver, create_requests, create_scheduler\n"
        "driver = StepDriver(create_scheduler(), FakeModelRunner())\n"
        "driver.add_requests(create_requests(3, max_tokens=4))\n"
        "results = driver.run()\n"
        "assert all(len(r.token_ids) == 4 for r in results.values())\n"
        "assert not any(name == 'torch' or name.startswith('torch.') for name in sys.modules\n"
        "               if sys.modules[name] is not None)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_scheduler_bench_runs_at_a_tiny_size():
    result = scheduler_bench.run(num_running=(2, 4), prompt_len=20, output_len=6, block_size=4)
    assert result["scenario"]["max_timed_decode_steps"] == 4
    for num_running in ("2", "4"):
        entry = result["kvserve"][num_running]
        assert entry["us_per_step"] > 0 and 1 <= entry["steps"] <= 4
        assert entry["us_per_request_step"] * int(num_running) == entry["us_per_step"]
    json.dumps(result)


def test_scheduler_bench_main_prints_json(capsys):
    scheduler_bench.main(["--num-running", "3", "--prompt-len", "9", "--output-len", "5", "--block-size", "4"])
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["kvserve"]) == {"3"}


def test_scheduler_bench_reports_a_broken_vllm_as_an_error(monkeypatch):
    """Where `vllm` looks importable but its scheduler cannot be built, the
    kvserve figures still come back and vLLM's entry names the failure."""
    real_find_spec = scheduler_bench.importlib.util.find_spec
    monkeypatch.setattr(scheduler_bench.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it raises
    result = scheduler_bench.run(num_running=(2,), prompt_len=8, output_len=4, block_size=4)
    assert result["kvserve"]["2"]["us_per_step"] > 0
    assert "error" in result["vllm"]["2"]
    assert result["ratio_kvserve_over_vllm"] == {}
