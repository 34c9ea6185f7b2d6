"""`kvserve run-batch`: every line of an OpenAI batch file answered exactly once, resumable.

The CLI runs the real default model on 50 mixed lines (valid requests to the four
endpoints, bodies the handlers refuse, and lines that cannot run at all); it is killed
mid-run and run again. The resume logic is also checked deterministically over the
fake engine, from an output file with answered lines and a cut-off last line.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvserve.server.app import build_app
from kvserve.server.batch import answered_keys, pending_lines, run_lines

from .fake_engine import make_fake_async_llm

MODEL = "smollm2"
ENGINE_FLAGS = ("--max-model-len", "512", "--kv-cache-memory", "64MiB")


def _request(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}})


def mixed_lines() -> tuple[list[str], dict[int, str]]:
    """50 non-blank lines (and one blank one), and what each non-blank line number must get:
    "ok" (status 200), "refused" (a 4xx body from the handler) or "problem" (an error line)."""
    chat = {"messages": [{"role": "user", "content": "Count to twenty."}], "ignore_eos": True}
    lines: list[tuple[str, str]] = []
    for i in range(12):
        lines.append((_request(f"chat-{i}", "/v1/chat/completions", {**chat, "max_tokens": 24}), "ok"))
    for i in range(12):
        lines.append((_request(f"cmpl-{i}", "/v1/completions", {"prompt": f"Number {i} is", "max_tokens": 24,
                                                               "ignore_eos": True}), "ok"))
    for i in range(5):
        lines.append((_request(f"resp-{i}", "/v1/responses", {"input": "Hi", "max_output_tokens": 8}), "ok"))
    for i in range(5):
        lines.append((_request(f"msg-{i}", "/v1/messages", {"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 8}), "ok"))
    lines += [
        (_request("neg-tokens", "/v1/chat/completions", {**chat, "max_tokens": -1}), "refused"),
        (_request("no-messages", "/v1/chat/completions", {}), "refused"),
        (_request("wrong-model", "/v1/completions", {"prompt": "x", "model": "gpt-17"}), "refused"),
        (_request("anthropic-bad", "/v1/messages", {"messages": [], "max_tokens": 4}), "refused"),
        ("{not json", "problem"),
        ('["a", "list"]', "problem"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), "problem"),
        (json.dumps({"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}), "problem"),
        (json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}), "problem"),
        (json.dumps({"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {}}), "problem"),
        (json.dumps({"custom_id": "body-list", "method": "POST", "url": "/v1/completions", "body": []}), "problem"),
        (_request("streamed", "/v1/completions", {"prompt": "x", "stream": True}), "problem"),
        (_request("chat-0", "/v1/completions", {"prompt": "x", "max_tokens": 2}), "problem"),  # duplicate id
        (_request("cmpl-3", "/v1/completions", {"prompt": "x", "max_tokens": 2}), "problem"),  # duplicate id
        ("\udcff\udcfe", "problem"),  # invalid UTF-8 bytes
        ("17", "problem"),
    ]
    assert len(lines) == 50
    texts, expected = [], {}
    for index, (text, kind) in enumerate(lines):
        if index == 20:
            texts.append("")  # a blank line is no request
        texts.append(text)
        expected[len(texts)] = kind
    return texts, expected


def write_input(path, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write("\n".join(texts) + "\n")


def check_results(output_path, texts: list[str], expected: dict[int, str]) -> None:
    with open(output_path, encoding="utf-8") as f:
        results = [json.loads(line) for line in f]
    assert len(results) == len(expected) == 50
    by_line: dict[int, dict] = {}
    ids = {}
    for number, text in enumerate(texts, start=1):
        if expected.get(number) in ("ok", "refused"):
            ids[json.loads(text)["custom_id"]] = number
    for result in results:
        assert result["id"].startswith("batch_req_")
        number = result["error"]["line"] if result["error"] else ids[result["custom_id"]]
        assert number not in by_line, f"line {number} answered twice"
        by_line[number] = result
    assert sorted(by_line) == sorted(expected)
    for number, kind in expected.items():
        result = by_line[number]
        if kind == "problem":
            assert result["response"] is None and result["error"]["message"].startswith(f"line {number}: ")
            continue
        response = result["response"]
        assert result["error"] is None and response["request_id"].startswith("req_")
        if kind == "refused":
            assert 400 <= response["status_code"] < 500 and "error" in response["body"]
            continue
        assert response["status_code"] == 200, response
        body, url = response["body"], json.loads(texts[number - 1])["url"]
        assert {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion",
                "/v1/responses": "response", "/v1/messages": "message"}[url] == body.get("object", body.get("type"))


def _run_cli(input_path, output_path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", "kvserve.cli", "run-batch", "-i", str(input_path),
                             "-o", str(output_path), "--served-model-name", MODEL, "--no-progress",
                             *ENGINE_FLAGS, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _num_lines(path) -> int:
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def test_cli_answers_every_line_once_and_resumes_after_a_kill(tmp_path):
    texts, expected = mixed_lines()
    input_path, output_path = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    write_input(input_path, texts)
    first = _run_cli(input_path, output_path, "--max-concurrency", "2")
    deadline = time.monotonic() + 300
    while _num_lines(output_path) < 25 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    answered_before = _num_lines(output_path)
    second = _run_cli(input_path, output_path)
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr.decode()
    if answered_before < 50:
        assert f"{answered_before} of 50 lines already answered" in stderr.decode()
    check_results(output_path, texts, expected)
    third = _run_cli(input_path, output_path)  # nothing left: no engine started, nothing written
    _, stderr = third.communicate(timeout=120)
    assert third.returncode == 0 and "50 of 50 lines already answered" in stderr.decode()
    check_results(output_path, texts, expected)


def test_cli_errors_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "run-batch", "-i", str(tmp_path / "missing"),
                             "-o", str(tmp_path / "out.jsonl")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "missing" in result.stderr


def test_resume_skips_answered_lines_and_drops_a_cut_off_one(tmp_path, tokenizer):
    texts = [_request(f"c{i}", "/v1/completions", {"prompt": f"n{i}", "max_tokens": 3}) for i in range(6)]
    texts += ["garbage", _request("c0", "/v1/completions", {"prompt": "dup"})]
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(input_path, texts)
    earlier = [{"id": "batch_req_1", "custom_id": "c1", "response": {"status_code": 200}, "error": None},
               {"id": "batch_req_2", "custom_id": None, "response": None,
                "error": {"code": "invalid_request", "message": "line 7: not valid JSON", "line": 7}}]
    with open(output_path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in earlier) + '{"id": "batch_req_3", "custom_id": "c2", "resp')
    todo, skipped = pending_lines(str(input_path), str(output_path))
    assert skipped == 2 and [line.number for line in todo] == [1, 3, 4, 5, 6, 8]
    assert answered_keys(str(output_path)) == {"custom_id:c1", "line:7"}  # the cut-off line is gone
    engine = make_fake_async_llm(tokenizer)
    try:
        app = build_app(engine, MODEL, shutdown_engine=False)
        assert asyncio.run(run_lines(app, todo, str(output_path), 3, show_progress=False)) == 6
    finally:
        engine.shutdown()
    with open(output_path) as f:
        results = [json.loads(line) for line in f]
    assert len(results) == 8
    assert sorted(r["custom_id"] for r in results if r["error"] is None) == [f"c{i}" for i in range(6)]
    assert all(r["response"]["body"]["object"] == "text_completion" for r in results[2:] if r["error"] is None)
    duplicate = [r for r in results if r["error"] and r["error"]["line"] == 8]
    assert len(duplicate) == 1 and "already used by line 1" in duplicate[0]["error"]["message"]
    assert pending_lines(str(input_path), str(output_path)) == ([], 8)


def test_output_must_differ_from_input(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="must not be the input"):
        pending_lines(str(path), str(path))
