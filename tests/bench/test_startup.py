"""`kvserve bench startup`: per-process timing and peak RSS, medians of per-round ratios, and a
real round of both engines on a tiny zoo model."""
from __future__ import annotations

import json
import sys

import pytest

from kvserve.bench import startup


def _run(kvserve: dict, llama: dict) -> dict:
    return {"kvserve": kvserve, "llama.cpp": llama}


def _figures(wall, first, cpu, rss):
    return {"wall_s": wall, "first_output_s": first, "cpu_s": cpu, "peak_rss_mib": rss}


def test_the_summary_is_the_median_of_per_round_ratios(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 2**20)
    runs = [_run(_figures(2.0, 1.0, 3.0, 900), _figures(1.0, 1.0, 1.0, 1000)),
            _run(_figures(3.0, 1.5, 3.0, 1000), _figures(1.0, 0.5, 2.0, 1000)),
            _run(_figures(9.0, 2.0, 3.0, 1200), _figures(2.0, 1.0, 3.0, 1000))]
    result = startup.summarize(runs, model_path=str(model))
    # Per-round wall ratios 2, 3, 4.5: median 3 (the ratio of the medians would be 3 / 1 = 3 too,
    # but first output's per-round ratios 1, 3, 2 give 2 where the medians' ratio is 1.5 / 1).
    assert result["ratio_kvserve_over_llama_cpp"] == {"wall_s": 3.0, "first_output_s": 2.0, "cpu_s": 1.5,
                                                      "peak_rss_mib": 1.0}
    assert result["median"]["kvserve"] == {"wall_s": 3.0, "first_output_s": 1.5, "cpu_s": 3.0, "peak_rss_mib": 1000}
    assert result["rounds"] == 3 and result["model_file_mib"] == 1.0


def test_a_process_is_timed_to_its_first_output_and_its_own_peak(tmp_path):
    script = ("import sys, time\n"
              "block = bytearray(300 * 2**20)\n"  # touched: 300 MiB resident at once
              "time.sleep(0.3)\n"
              "print('first', flush=True)\n"
              "time.sleep(0.3)\n"
              "print('second')\n")
    figures = startup.time_process([sys.executable, "-c", script])
    assert figures["returncode"] == 0 and figures["output"] == "first\nsecond\n"
    assert 0.3 <= figures["first_output_s"] < figures["wall_s"]
    assert figures["wall_s"] >= 0.6
    assert figures["peak_rss_mib"] >= 300
    assert figures["cpu_s"] > 0


def test_a_file_can_be_evicted_from_the_page_cache(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65536)
    assert startup.evict_from_page_cache([str(path), str(tmp_path / "missing")]) == [str(path)]


def test_a_round_of_both_engines_on_a_tiny_zoo_model(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from kvserve.bench import zoo
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    path = zoo.resolve_zoo_model("zoo:tiny-llama-f16")
    result = startup.run(path, rounds=2, max_tokens=4, cold=True, n_ctx=256)
    assert result["rounds"] == 2 and [run["order"] for run in result["runs"]] == [
        ["kvserve", "llama.cpp"], ["llama.cpp", "kvserve"]]
    for run in result["runs"]:
        for engine in ("kvserve", "llama.cpp"):
            assert run[engine]["returncode"] == 0 and run[engine]["first_output_s"] is not None
            assert run[engine]["peak_rss_mib"] > 0
    assert all(result["ratio_kvserve_over_llama_cpp"][metric] > 0 for metric in startup.METRICS)
    assert result["commands"]["kvserve"].startswith(f"kvserve generate --model {path} Hi --max-tokens 4")
    json.dumps(result)  # the JSON the CLI writes
    assert "kvserve / llama.cpp" in startup.format_result(result)
