"""`kvserve bench serve-compare` against llama.cpp's own llama-server: finding the binary
(given, on PATH, or cached by scripts/build_llama_server.sh) and one tiny run with both
servers when a binary exists."""
from __future__ import annotations

import signal
import stat
import sys
from pathlib import Path

import pytest

from kvserve.bench import serve, serve_compare


def _executable(path) -> str:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_llama_server_is_found_given_on_path_or_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert serve_compare.find_llama_server() is None
    (tmp_path / "cache").mkdir()
    cached = _executable(tmp_path / "cache" / "llama-server")
    assert serve_compare.find_llama_server() == cached
    (tmp_path / "bin").mkdir()
    on_path = _executable(tmp_path / "bin" / "llama-server")
    assert serve_compare.find_llama_server() == on_path  # PATH wins over the cache
    given = _executable(tmp_path / "mine")
    assert serve_compare.find_llama_server(given) == given
    command = serve_compare.llama_cpp_command("m.gguf", 8, 2, 512, serve_compare.find_llama_server())
    assert command.argv[0] == on_path and command.note == "llama-server --parallel 8"
    assert command.argv[command.argv.index("-c") + 1] == str(8 * 512)  # context per slot times slots


def test_a_missing_llama_server_is_a_clear_error(tmp_path):
    (tmp_path / "plain").write_text("not a program")
    for bad in (str(tmp_path / "absent"), str(tmp_path / "plain")):
        with pytest.raises(ValueError, match="not an executable file"):
            serve_compare.find_llama_server(bad)


@pytest.mark.slow
@pytest.mark.skipif(serve_compare.find_llama_server() is None,
                    reason="no llama-server binary (scripts/build_llama_server.sh builds one; not part of CI)")
def test_serve_compare_runs_both_servers_on_the_default_model():
    from kvserve.engine.model_path import default_model_path

    config = serve.ServeBenchConfig(endpoint="chat", num_prompts=4, prompt_words=16, max_tokens=8, concurrency=2,
                                    timeout_s=300.0)
    result = serve_compare.run(default_model_path(), config, rounds=1, context_per_slot=512,
                               kvserve_args=["--kv-cache-memory", "64MiB", "--max-model-len", "512"])
    llama = result["servers"]["llama.cpp"]
    assert llama["note"] == "llama-server --parallel 2" and "--parallel" in llama["command"]
    for name in ("kvserve", "llama.cpp"):
        summary = result["servers"][name]["summary"]
        assert summary["failed"] == 0 and summary["output_token_throughput"] > 0
        assert result["servers"][name]["rounds"][0]["completed"] == 4
    assert set(result["ratios"]) == {"output_tok_s", "tpot_mean", "ttft_mean"}


FAKE_SERVER = str(Path(__file__).with_name("fake_openai_server.py"))


def _fake_command(name: str, *flags: str) -> serve_compare.ServerCommand:
    return serve_compare.ServerCommand(name, [sys.executable, FAKE_SERVER, "--port", "{port}", *flags], "fake")


def test_a_reference_server_that_crashes_is_recorded_and_said(tmp_path):
    """llama.cpp's server killed by a signal in round 2 (its second start, on the first measured
    request): recorded with its signal and round, printed, and out of round 3; the figures and
    the ratios cover round 1, where both ran."""
    config = serve.ServeBenchConfig(endpoint="completions", num_prompts=3, prompt_words=4, max_tokens=4,
                                    concurrency=1, timeout_s=30.0)
    reference = _fake_command("llama.cpp", "--count-file", str(tmp_path / "starts"), "--crash-in-start", "2",
                              "--crash-on-request", "2")
    runs, failures = serve_compare._run_rounds([_fake_command("kvserve"), reference], config, rounds=3)
    assert [len(runs["kvserve"]), len(runs["llama.cpp"])] == [3, 1]
    [failure] = failures
    assert {k: failure[k] for k in ("engine", "phase", "round", "signal", "exit_code", "action")} == {
        "engine": "llama.cpp", "phase": "run", "round": 2, "signal": "SIGSEGV", "exit_code": -signal.SIGSEGV,
        "action": "left out of the later rounds"}
    assert "died while serving the benchmark (killed by SIGSEGV)" in failure["error"]
    assert (tmp_path / "starts").read_text() == "2"
    assert "REFERENCE FAILED: llama.cpp killed by SIGSEGV (round 2)" in serve_compare.format_failures(failures)


def test_a_reference_server_that_crashes_at_start_is_recorded_and_said():
    config = serve.ServeBenchConfig(endpoint="completions", num_prompts=2, prompt_words=4, max_tokens=2,
                                    concurrency=1, timeout_s=30.0)
    crashing = serve_compare.ServerCommand("llama.cpp", [sys.executable, "-c",
                                                         "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    runs, failures = serve_compare._run_rounds([_fake_command("kvserve"), crashing], config, rounds=2)
    assert [len(runs["kvserve"]), len(runs["llama.cpp"])] == [2, 0]
    assert [(f["phase"], f["round"], f["signal"]) for f in failures] == [("start", 1, "SIGSEGV")]
    servers = serve_compare._servers([_fake_command("kvserve"), crashing], runs)
    assert servers["llama.cpp"]["summary"] is None
    result = {"servers": servers, "rounds": 2, "threads": 1, "ratios": {}, "skipped": {},
              "reference_failures": failures}
    text = serve_compare.format_result(result)
    assert "no round finished" in text and "REFERENCE FAILED: llama.cpp killed by SIGSEGV (round 1)" in text
