"""AsyncLLM on its own (no HTTP): many coroutines, one engine thread."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.errors import EngineDeadError, EngineOverloadedError, PromptTooLongError
from kvserve.sampling_params import SamplingParams

from .fake_engine import make_fake_async_llm


@pytest.fixture
def engine(tokenizer):
    engine = make_fake_async_llm(tokenizer, max_model_len=128, max_num_seqs=4, step_delay_s=0.002)
    yield engine
    engine.shutdown()


def _wait_idle(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.engine_core.scheduler.requests or engine.num_in_flight_requests():
        assert time.monotonic() < deadline, "engine still busy"
        time.sleep(0.01)


def test_many_coroutines_get_their_own_outputs(engine):
    params = SamplingParams(temperature=0, max_tokens=5)

    async def one(prompt: str) -> tuple[str, str]:
        final = None
        async for output in engine.generate(prompt, params):
            final = output
        return prompt, final.outputs[0].text

    async def scenario():
        return await asyncio.gather(*[one(f"prompt number {i}") for i in range(12)])

    concurrent = dict(asyncio.run(scenario()))
    alone = {p: asyncio.run(scenario_single(engine, p, params)) for p in list(concurrent)[:3]}
    for prompt, text in alone.items():
        assert concurrent[prompt] == text
    assert len(engine.engine_core.executor.step_thread_ids) == 1


async def scenario_single(engine, prompt, params) -> str:
    final = None
    async for output in engine.generate(prompt, params):
        final = output
    return final.outputs[0].text


def test_slow_consumer_gets_merged_deltas(engine):
    async def scenario():
        outputs = []
        async for output in engine.generate("a slow reader", SamplingParams(temperature=0, max_tokens=40)):
            outputs.append(output)
            await asyncio.sleep(0.03)
        return outputs

    outputs = asyncio.run(scenario())
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 40
    assert len(outputs) < 40, "a slow consumer should see merged outputs"
    assert "".join(o.outputs[0].new_text for o in outputs) == final.text
    assert [t for o in outputs for t in o.outputs[0].new_token_ids] == final.token_ids


def test_abort_from_another_coroutine_ends_the_stream(engine):
    async def scenario() -> list:
        outputs = []

        async def consume() -> None:
            async for output in engine.generate("abc", SamplingParams(max_tokens=100), "r1"):
                outputs.append(output)

        task = asyncio.create_task(consume())
        while len(outputs) < 2:
            await asyncio.sleep(0.005)
        await engine.abort("r1")
        await asyncio.wait_for(task, 10)
        return outputs

    outputs = asyncio.run(scenario())
    assert not outputs[-1].finished
    _wait_idle(engine)
    assert engine.engine_core.aborted_ids == ["r1"]


def test_cancelled_consumer_aborts(engine):
    async def scenario() -> None:
        async def consume() -> None:
            async for _ in engine.generate("xyz", SamplingParams(max_tokens=100), "r2"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    _wait_idle(engine)
    assert engine.engine_core.aborted_ids == ["r2"]


def test_rejections_before_submission(engine):
    async def first(prompt, params):
        async for output in engine.generate(prompt, params):
            return output

    with pytest.raises(PromptTooLongError, match="128"):
        asyncio.run(first("word " * 200, SamplingParams(max_tokens=4)))
    with pytest.raises(PromptTooLongError, match="128"):
        asyncio.run(first("short", SamplingParams(max_tokens=500)))
    engine.max_concurrent_requests = 0
    with pytest.raises(EngineOverloadedError):
        asyncio.run(first("short", SamplingParams(max_tokens=4)))
    engine.max_concurrent_requests = None
    assert asyncio.run(first("short", SamplingParams(max_tokens=4))) is not None


def test_engine_error_fails_waiting_requests_and_later_ones(engine):
    async def scenario():
        async def consume():
            async for _ in engine.generate("doomed", SamplingParams(max_tokens=100)):
                pass

        task = asyncio.create_task(consume())
        while not engine.engine_core.scheduler.requests:
            await asyncio.sleep(0.005)
        engine.engine_core.executor.fail_next_step = RuntimeError("device lost")
        return await asyncio.gather(task, return_exceptions=True)

    [error] = asyncio.run(scenario())
    assert isinstance(error, EngineDeadError) and "device lost" in str(error)
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(scenario_single(engine, "later", SamplingParams(max_tokens=2)))


def test_shutdown_fails_in_flight_and_stops_the_core(engine):
    async def scenario():
        async def consume():
            async for _ in engine.generate("long", SamplingParams(max_tokens=100)):
                pass

        task = asyncio.create_task(consume())
        while not engine.engine_core.scheduler.requests:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engine.shutdown)
        return await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)

    [error] = asyncio.run(scenario())
    assert isinstance(error, EngineDeadError)
    assert engine.engine_core.executor.is_shut_down and not engine.engine_core.scheduler.requests


def test_dropped_handle_aborts_its_request(engine):
    import gc

    async def scenario() -> None:
        handle = engine.add_request("dropped", SamplingParams(max_tokens=100), "r3")
        await handle.__anext__()
        del handle
        gc.collect()

    asyncio.run(scenario())
    _wait_idle(engine)
    assert engine.engine_core.aborted_ids == ["r3"]


def test_bad_constraint_raises_before_the_request_is_queued(engine, monkeypatch):
    """AsyncLLM.generate compiles through the engine's RequestValidator first (as LLM and the server do)."""
    from concurrent.futures import Future

    from kvserve.sample.structured import grammar
    from kvserve.sampling_params import StructuredOutputsParams

    class RefusingCompiler:
        def compile_async(self, params):
            future = Future()
            future.set_exception(grammar.StructuredOutputError(params.kind, "unbalanced parenthesis"))
            return future

    monkeypatch.setattr(grammar, "compiler_for_model", lambda model_config, load_tokenizer: RefusingCompiler())
    bad = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="(a"))

    async def scenario():
        async for _ in engine.generate("a prompt", bad):
            pass

    with pytest.raises(grammar.StructuredOutputError, match="unbalanced"):
        asyncio.run(scenario())
    assert not engine.engine_core.scheduler.requests and engine.num_in_flight_requests() == 0
