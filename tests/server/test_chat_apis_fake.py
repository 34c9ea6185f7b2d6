"""The Responses and Messages APIs over the model-free engine: failures before and during a
stream, and overload, each in its API's own shape (fake_engine.py: the real EngineCore,
AsyncLLM and HTTP stack over a fake executor whose next step can be made to fail)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from kvserve.server.app import build_app

from .conftest import ThreadedServer
from .fake_engine import make_fake_async_llm

MODEL = "fake-model"
RESPONSES_BODY = {"model": MODEL, "input": "hello", "max_output_tokens": 40}
MESSAGES_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 40}


@pytest.fixture(scope="module")
def fake_server(tokenizer):
    engine = make_fake_async_llm(tokenizer, max_model_len=256, max_num_seqs=8, step_delay_s=0.01)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        server.engine = engine
        yield server


def _sse_events(response: httpx.Response, executor) -> list[tuple[str, dict]]:
    """(event name, payload) of a stream; the executor's next step fails once the first text arrived."""
    events, name, armed = [], None, False
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
            if name in ("response.output_text.delta", "content_block_delta") and not armed:
                executor.error_next_step, armed = RuntimeError("bad kernel"), True
    return events


def test_failure_before_anything_is_a_500_in_each_shape(fake_server):
    executor = fake_server.engine.engine_core.executor
    executor.error_next_step = RuntimeError("bad kernel")
    response = httpx.post(fake_server.base_url + "/v1/responses", json=RESPONSES_BODY, timeout=30)
    assert response.status_code == 500 and "bad kernel" in response.json()["error"]["message"]
    executor.error_next_step = RuntimeError("bad kernel")
    response = httpx.post(fake_server.base_url + "/v1/messages", json=MESSAGES_BODY, timeout=30)
    assert response.status_code == 500
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "api_error"


def test_responses_stream_failure_is_an_error_event(fake_server):
    executor = fake_server.engine.engine_core.executor
    executor.error_next_step = None
    with httpx.stream("POST", fake_server.base_url + "/v1/responses", json={**RESPONSES_BODY, "stream": True},
                      timeout=30) as response:
        assert response.status_code == 200
        events = _sse_events(response, executor)
    names = [name for name, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "error"
    assert "response.completed" not in names
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    error = events[-1][1]
    assert error["type"] == "error" and "bad kernel" in error["message"]
    reply = httpx.post(fake_server.base_url + "/v1/responses", json=RESPONSES_BODY, timeout=30).json()
    assert reply["status"] == "incomplete" and reply["usage"]["output_tokens"] == 40


def test_messages_stream_failure_is_an_error_event(fake_server):
    executor = fake_server.engine.engine_core.executor
    executor.error_next_step = None
    with httpx.stream("POST", fake_server.base_url + "/v1/messages", json={**MESSAGES_BODY, "stream": True},
                      timeout=30) as response:
        assert response.status_code == 200
        events = _sse_events(response, executor)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-1] == "error"
    assert "message_stop" not in names
    error = events[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "bad kernel" in error["error"]["message"]
    reply = httpx.post(fake_server.base_url + "/v1/messages", json=MESSAGES_BODY, timeout=30).json()
    assert reply["stop_reason"] == "max_tokens" and reply["usage"]["output_tokens"] == 40


def test_busy_server_is_anthropic_529_and_openai_503(tokenizer):
    import threading

    engine = make_fake_async_llm(tokenizer, max_num_seqs=1, max_waiting_requests=0, step_delay_s=0.02)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        running = threading.Thread(target=httpx.post, args=(server.base_url + "/v1/completions",),
                                   kwargs={"json": {"model": MODEL, "prompt": "slow", "max_tokens": 60},
                                           "timeout": 30})
        running.start()
        while engine.num_in_flight_requests() < 1:
            time.sleep(0.01)
        anthropic_busy = httpx.post(server.base_url + "/v1/messages", json=MESSAGES_BODY, timeout=30)
        openai_busy = httpx.post(server.base_url + "/v1/responses", json=RESPONSES_BODY, timeout=30)
        running.join(30)
    assert anthropic_busy.status_code == 529
    assert anthropic_busy.json()["error"]["type"] == "overloaded_error"
    assert anthropic_busy.headers["retry-after"].isdigit()
    assert openai_busy.status_code == 503 and openai_busy.json()["error"]["code"] == "server_busy"
