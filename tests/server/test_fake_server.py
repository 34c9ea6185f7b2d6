"""The server over a model-free engine core: protocol, errors, limits, aborts.

The engine core is the real `EngineCore` over a fake executor (fake_engine.py); AsyncLLM, the OutputProcessor, the
tokenizer (the default model's) and the whole HTTP stack are the real ones.
The official `openai` client is the oracle for the protocol.
"""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from kvserve.engine.tokenizer import apply_chat_template
from kvserve.server.app import build_app
from kvserve.testing import assert_pool_whole

from .bad_inputs import check_error_shape, run_bad_input_table
from .conftest import ThreadedServer, metric_values
from .fake_engine import make_fake_async_llm

MODEL = "fake-model"
API_KEY = "test-key"


@pytest.fixture(scope="module")
def fake_server(tokenizer):
    engine = make_fake_async_llm(tokenizer, max_model_len=256, max_num_seqs=8)
    app = build_app(engine, MODEL, api_key=API_KEY)
    with ThreadedServer(app) as server:
        server.engine = engine
        yield server
    assert engine.engine_core.executor.is_shut_down, "the app's shutdown did not stop the engine"


@pytest.fixture
def client(fake_server):
    return openai.OpenAI(base_url=fake_server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _wait_idle(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.engine_core.scheduler.requests and engine.num_in_flight_requests() == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {list(engine.engine_core.scheduler.requests)}")


def test_models_health_version(client, fake_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(fake_server.base_url + "/health")
    assert health.status_code == 200
    version = httpx.get(fake_server.base_url + "/version").json()
    import kvserve
    assert version["version"] == kvserve.__version__


def test_completion_matches_stream_and_usage(client, tokenizer):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 7
    assert full.usage.total_tokens == full.usage.prompt_tokens + 7
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) >= 2, "streamed text should arrive in several chunks"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_usage_counts_the_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5,
                                           temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens == len(apply_chat_template(tokenizer, messages))
    assert reply.usage.completion_tokens == 5


def test_chat_stream_role_first_then_deltas_then_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    contents = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert len(contents) >= 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    full = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6, temperature=0)
    assert "".join(contents) == full.choices[0].message.content


def test_n_seed_reproducible_and_distinct(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1, "n samples with one seed should differ"
    assert first.usage.completion_tokens == 24


def test_chat_stream_with_n_matches_the_full_reply(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Pick words"}], max_tokens=6,
                  temperature=1.0, seed=99, n=2)
    full = client.chat.completions.create(**kwargs)
    pieces = {0: "", 1: ""}
    finishes = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert pieces == {c.index: c.message.content for c in full.choices}
    assert finishes == {0: "length", 1: "length"}


def test_multiple_prompts_and_token_ids(client, tokenizer):
    ids = tokenizer.encode("Hello world")
    reply = client.completions.create(model=MODEL, prompt=["a b c", "Hello world"], max_tokens=3,
                                      temperature=0, n=2)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    from_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    by_index = {c.index: c.text for c in reply.choices}
    assert from_ids.choices[0].text == by_index[2] == by_index[3]
    from_id_lists = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=3, temperature=0)
    assert [c.text for c in from_id_lists.choices] == [by_index[2]] * 2


def test_stop_string_is_cut(client):
    base = client.completions.create(model=MODEL, prompt="Go", max_tokens=12, temperature=0)
    words = base.choices[0].text.split()
    stop_word = words[3]
    cut = client.completions.create(model=MODEL, prompt="Go", max_tokens=12, temperature=0,
                                    stop=[" " + stop_word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base.choices[0].text.split(" " + stop_word)[0]


def test_logprobs_and_echo(client):
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                      logprobs=2, echo=True)
    choice = reply.choices[0]
    assert choice.text.startswith("Hi")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.prompt_tokens + 4
    assert lp.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[-4:])
    assert all(len(top) >= 2 for top in lp.top_logprobs[-4:])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_echo_scores_the_prompt_and_max_tokens_zero_returns_it_alone(client):
    prompt = "Score this prompt"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True)
    lp = full.choices[0].logprobs
    num_prompt = full.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])  # prompt tokens scored, then the 2 sampled
    assert all(top for top in lp.top_logprobs[1:])
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice = only.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == num_prompt
    assert choice.logprobs.tokens == lp.tokens[:num_prompt]
    assert choice.logprobs.token_logprobs == lp.token_logprobs[:num_prompt]
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt
    assert [x for c in streamed if c.choices and c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs[:num_prompt]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_vllm_prompt_logprobs_field(fake_server, client):
    echoed = client.completions.create(model=MODEL, prompt="Score me please", max_tokens=0, logprobs=0, echo=True)
    prompt_ids = echoed.choices[0].logprobs.tokens
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Score me please", "max_tokens": 1, "prompt_logprobs": 1}
    reply = httpx.post(fake_server.base_url + "/v1/completions", json=body, headers=headers, timeout=30).json()
    scored = reply["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) == reply["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(position) >= 1 and all(set(entry) == {"logprob", "rank", "decoded_token"}
                                           for entry in position.values()) for position in scored[1:])
    streamed = httpx.post(fake_server.base_url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=30)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    too_many = httpx.post(fake_server.base_url + "/v1/completions", json={**body, "prompt_logprobs": 21},
                          headers=headers, timeout=30)
    assert too_many.status_code == 400 and "prompt_logprobs" in too_many.json()["error"]["message"]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_add_up_to_the_full_ones(client, echo):
    kwargs = dict(model=MODEL, prompt="Hi there", max_tokens=6, temperature=0, logprobs=1, echo=echo)
    full = client.completions.create(**kwargs).choices[0].logprobs
    tokens, token_logprobs, offsets = [], [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            lp = chunk.choices[0].logprobs
            tokens += lp.tokens
            token_logprobs += lp.token_logprobs
            offsets += lp.text_offset
    assert (tokens, token_logprobs, offsets) == (full.tokens, full.token_logprobs, full.text_offset)


def test_bad_input_table_then_still_serving(fake_server, client):
    kwargs = dict(model=MODEL, prompt="A request in flight", max_tokens=200, temperature=0)
    streamed: list[str] = []
    bystander = threading.Thread(target=lambda: streamed.extend(
        c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices))
    bystander.start()
    failures = run_bad_input_table(fake_server.base_url, MODEL, API_KEY, max_model_len=256)
    bystander.join(60)
    assert not failures, "\n".join(failures)
    assert "".join(streamed) == client.completions.create(**kwargs).choices[0].text, \
        "a request in flight during the bad inputs must be unaffected"
    reply = client.completions.create(model=MODEL, prompt="Still alive?", max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    _wait_idle(fake_server.engine)


def test_huge_prompts_are_tokenized_off_the_loop_and_rejected(client):
    huge = "hello " * 300_000  # 1.8 MB: tokenized on a worker thread
    with pytest.raises(openai.BadRequestError, match="256"):
        client.completions.create(model=MODEL, prompt=huge, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="256"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}], max_tokens=2)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    assert "tool_choice" in str(info.value)


def test_streaming_disconnect_aborts(fake_server):
    engine = fake_server.engine
    core = engine.engine_core
    aborted_before = len(core.aborted_ids)
    body = {"model": MODEL, "prompt": "Count forever", "max_tokens": 200, "stream": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=fake_server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            lines = response.iter_lines()
            data_lines = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in data_lines)
    _wait_idle(engine)
    assert len(core.aborted_ids) == aborted_before + 1
    assert_pool_whole(core.scheduler)


def test_non_streaming_disconnect_aborts(fake_server):
    engine = fake_server.engine
    core = engine.engine_core
    aborted_before = len(core.aborted_ids)
    body = {"model": MODEL, "prompt": "Long answer", "max_tokens": 240}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fake_server.base_url + "/v1/completions", json=body, timeout=0.2,
                   headers={"authorization": f"Bearer {API_KEY}"})
    _wait_idle(engine)
    assert len(core.aborted_ids) == aborted_before + 1


def test_metrics_after_traffic(fake_server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    _wait_idle(fake_server.engine)
    time.sleep(0.6)  # the idle engine loop refreshes its stats snapshot
    values = metric_values(fake_server.base_url)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
    assert values["vllm:generation_tokens_total"] >= 3
    assert values["vllm:time_to_first_token_seconds_count"] >= 1
    for name in ("vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:num_preemptions_total",
                 "kvserve_prefix_cache_hit_rate", "vllm:num_requests_waiting"):
        assert name in values, name


def test_engine_loop_is_one_thread(fake_server):
    assert len(fake_server.engine.engine_core.executor.step_thread_ids) == 1


# ----- servers of their own: limits, engine failure, shutdown -----

def test_failed_step_gives_500_and_engine_keeps_serving(fake_server, client):
    executor = fake_server.engine.engine_core.executor
    executor.error_next_step = RuntimeError("bad kernel")
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="unlucky", max_tokens=3)
    assert "bad kernel" in str(info.value)
    executor.error_next_step = RuntimeError("bad kernel")
    with httpx.stream("POST", fake_server.base_url + "/v1/completions", timeout=30,
                      headers={"authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "unlucky", "max_tokens": 3, "stream": True}) as response:
        status = response.status_code
        body = response.read().decode()
    assert status == 500 and "bad kernel" in body, (status, body)
    reply = client.completions.create(model=MODEL, prompt="lucky", max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_chunked_body_over_the_limit_gives_413(fake_server):
    def chunks():
        for _ in range(80):
            yield b"a" * 65536

    response = httpx.post(fake_server.base_url + "/v1/completions", content=chunks(), timeout=30,
                          headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert response.status_code == 413
    check_error_shape(response)


def test_queue_full_gives_503_with_retry_after(tokenizer):
    engine = make_fake_async_llm(tokenizer, max_num_seqs=2, max_concurrent_requests=2, step_delay_s=0.02)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        body = {"model": MODEL, "prompt": "slow", "max_tokens": 50, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as first, \
                    http.stream("POST", "/v1/completions", json=body) as second:
                assert first.status_code == second.status_code == 200
                third = http.post("/v1/completions", json={**body, "stream": False})
                assert third.status_code == 503
                assert third.headers["retry-after"].isdigit()
                check_error_shape(third)
            _wait_idle(engine)
            ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "now", "max_tokens": 2})
            assert ok.status_code == 200


def test_admission_cap_is_exact_under_a_burst(tokenizer):
    import asyncio

    engine = make_fake_async_llm(tokenizer, max_num_seqs=8, max_concurrent_requests=4, step_delay_s=0.02)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
                responses = await asyncio.gather(*[
                    http.post("/v1/completions", json={"model": MODEL, "prompt": f"burst {i}", "max_tokens": 40})
                    for i in range(12)])
            return sorted(r.status_code for r in responses)

        assert asyncio.run(burst()) == [200] * 4 + [503] * 8


def test_waiting_queue_full_gives_503(tokenizer):
    engine = make_fake_async_llm(tokenizer, max_num_seqs=1, max_waiting_requests=1, step_delay_s=0.02)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        body = {"model": MODEL, "prompt": "slow", "max_tokens": 30}
        statuses = []

        def post() -> None:
            statuses.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=30).status_code)

        workers = [threading.Thread(target=post) for _ in range(2)]  # one running, one waiting
        for worker in workers:
            worker.start()
        while engine.num_in_flight_requests() < 2:
            time.sleep(0.01)
        rejected = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert rejected.status_code == 503 and "waiting" in check_error_shape(rejected)["message"]
        assert rejected.headers["retry-after"].isdigit()
        for worker in workers:
            worker.join(30)
        assert statuses == [200, 200]


def test_engine_failure_reaches_waiting_requests(tokenizer):
    engine = make_fake_async_llm(tokenizer, step_delay_s=0.01)
    with ThreadedServer(build_app(engine, MODEL)) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as http:
            body = {"model": MODEL, "prompt": "doomed", "max_tokens": 100}
            result = {}
            worker = threading.Thread(target=lambda: result.update(r=http.post("/v1/completions", json=body)))
            worker.start()
            while not engine.engine_core.scheduler.requests:
                time.sleep(0.01)
            engine.engine_core.executor.fail_next_step = RuntimeError("device lost")
            worker.join(20)
            response = result["r"]
            assert response.status_code == 503
            assert "device lost" in check_error_shape(response)["message"]
            assert http.get("/health").status_code == 503
            after = http.post("/v1/completions", json=body)
            assert after.status_code == 503


def test_shutdown_with_streams_in_flight_does_not_hang(tokenizer):
    engine = make_fake_async_llm(tokenizer, step_delay_s=0.05)
    server = ThreadedServer(build_app(engine, MODEL))
    server.server.config.timeout_graceful_shutdown = 1
    received: list[str] = []

    def stream_forever() -> None:
        body = {"model": MODEL, "prompt": "endless", "max_tokens": 240, "stream": True}
        try:
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    received.append(line)
        except httpx.HTTPError:
            pass

    with server:
        reader = threading.Thread(target=stream_forever)
        reader.start()
        while len(received) < 3:
            time.sleep(0.01)
        started = time.monotonic()
    assert time.monotonic() - started < 15
    reader.join(10)
    assert not reader.is_alive()
    assert engine.engine_core.executor.is_shut_down and not engine.engine_core.scheduler.requests
