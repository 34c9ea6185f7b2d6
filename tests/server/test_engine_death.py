"""A dead executor through AsyncLLM and the HTTP server: EngineDeadError naming node and rank
to every waiting and later request, /health 503 in the OpenAI error shape, then a clean exit.

The fake executor dies at a chosen point (`FakeExecutor.kill`): when the next step is
submitted, when its result is collected, or in a health check while nothing runs.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from helpers.server_process import free_port

from kvserve.errors import EngineDeadError
from kvserve.sampling_params import SamplingParams
from kvserve.server.app import build_app
from kvserve.server.launch import serve_until_stopped

from .fake_engine import make_fake_async_llm

REASON = "lost tensor-parallel rank 1 on node 1: no answer to a heartbeat within 5 s"
MODEL = "fake-model"


@pytest.fixture
def engine(tokenizer):
    engine = make_fake_async_llm(tokenizer, max_model_len=128, max_num_seqs=4, step_delay_s=0.005)
    yield engine
    engine.shutdown()


def _kill_once_running(engine, when: str) -> None:
    """Kill the executor at `when` as soon as a request is in the scheduler."""
    deadline = time.monotonic() + 10
    while not engine.engine_core.scheduler.requests:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.002)
    if when == "collect":
        engine.engine_core.schedule_ahead = False  # the failed step is collected before another is submitted
    engine.engine_core.executor.kill(REASON, when=when)


@pytest.mark.parametrize("when", ["submit", "collect"])
def test_async_llm_fails_the_running_request_and_later_ones(engine, when):
    async def scenario():
        async def consume():
            async for _ in engine.generate("doomed", SamplingParams(max_tokens=100, ignore_eos=True)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.to_thread(_kill_once_running, engine, when)
        return await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)

    [error] = asyncio.run(scenario())
    assert isinstance(error, EngineDeadError) and "rank 1 on node 1" in str(error)
    assert engine.wait_until_dead(5)
    with pytest.raises(EngineDeadError, match="rank 1 on node 1"):
        engine.check_health()


def test_async_llm_notices_a_death_while_idle(engine):
    engine.check_health()
    assert not engine.wait_until_dead(0)
    engine.engine_core.executor.kill(REASON, when="now")
    with pytest.raises(EngineDeadError, match="rank 1 on node 1"):
        engine.check_health()  # at once, asked directly
    assert engine.wait_until_dead(5)  # the idle loop found it too
    assert not engine.is_running

    async def later():
        async for _ in engine.generate("later", SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(EngineDeadError, match="rank 1 on node 1"):
        asyncio.run(later())


class _Server:
    """`serve_until_stopped` over the fake engine, on a thread; `exit_code` once it returned."""

    def __init__(self, engine, exit_on_engine_death: bool = True) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(engine, MODEL), host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(engine, exit_on_engine_death), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "test server did not start"
            time.sleep(0.02)

    def _run(self, engine, exit_on_engine_death: bool) -> None:
        self.exit_code = serve_until_stopped(self.server, engine, exit_on_engine_death=exit_on_engine_death,
                                             exit_delay_s=1.0)

    def wait_exit(self, timeout_s: float) -> int | None:
        self.thread.join(timeout_s)
        return self.exit_code

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


def _assert_engine_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "engine_unavailable"
    assert "rank 1 on node 1" in error["message"], error


def _complete(base_url: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=30)


@pytest.mark.parametrize("when", ["submit", "collect", "now"])
def test_server_answers_503_naming_the_rank_then_exits(engine, when):
    server = _Server(engine)
    try:
        assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
        if when == "now":
            engine.engine_core.executor.kill(REASON, when="now")
        else:
            killer = threading.Thread(target=_kill_once_running, args=(engine, when))
            killer.start()
            _assert_engine_unavailable(_complete(server.base_url, max_tokens=100))  # the request in flight
            killer.join()
        _assert_engine_unavailable(httpx.get(server.base_url + "/health"))
        _assert_engine_unavailable(_complete(server.base_url, max_tokens=2))
        assert server.wait_exit(15) == 1, "the server did not exit after the engine died"
    finally:
        server.stop()
    assert engine.engine_core.executor.is_shut_down


def test_without_exit_on_lost_node_the_server_stays_up_answering_503(engine):
    server = _Server(engine, exit_on_engine_death=False)
    try:
        engine.engine_core.executor.kill(REASON, when="now")
        assert engine.wait_until_dead(5)
        time.sleep(1.5)  # past the exit delay
        assert server.thread.is_alive()
        _assert_engine_unavailable(httpx.get(server.base_url + "/health"))
    finally:
        server.stop()
    assert server.exit_code == 0
