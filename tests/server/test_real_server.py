"""The real server (default model, subprocess on 127.0.0.1) through the openai client.

Oracles: `LLM.generate` / `LLM.chat` in this process for greedy outputs, the
openai client for the protocol, and the server's own non-streaming answer for
what its stream must add up to.
"""
from __future__ import annotations

import json
import math
import os
import signal
import time

import httpx
import openai
import pytest
from helpers.server_process import ServerProcess

from kvserve import LLM, SamplingParams

from .bad_inputs import run_bad_input_table
from .conftest import metric_values, wait_for_idle

MODEL = "smollm2"
API_KEY = "sk-test-real"
MAX_MODEL_LEN = 1024
ENGINE_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def server():
    # A drain window far past the 22 tokens test_sigterm_lets_an_in_flight_stream_finish waits
    # for (the default 10 s is for users; on a loaded 2-core CI machine a step can take 100x longer).
    process = ServerProcess("--api-key", API_KEY, "--served-model-name", MODEL, "--shutdown-timeout", "120",
                            *ENGINE_FLAGS)
    yield process
    # uvicorn re-raises the signal after its graceful shutdown, hence -SIGTERM.
    assert process.stop() in (0, -signal.SIGTERM), process.log_text()
    assert "server shut down cleanly" in process.log_text()
    process.remove_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference_llm():
    llm = LLM(max_model_len=MAX_MODEL_LEN, kv_cache_memory="64MiB")
    yield llm
    llm.shutdown()


def test_greedy_completions_equal_llm_generate(client, reference_llm):
    expected = reference_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert texts == [out.outputs[0].text for out in expected]
    assert reply.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)
    assert reply.usage.completion_tokens == sum(len(out.outputs[0].token_ids) for out in expected)


def test_greedy_chat_equals_llm_chat(client, reference_llm):
    messages = [{"role": "user", "content": "Name a primary colour."}]
    expected = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_stream_is_incremental_and_ends_with_usage(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}],
                  max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs)
    arrivals, pieces, usage = [], [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].message.content
    assert len(pieces) >= 8, "one chunk per token or so, not one blob"
    assert arrivals[-1] - arrivals[0] > 0.01, "chunks should arrive over time, not all at once"
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_n_and_seed(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0, n=3, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    other_seed = client.completions.create(**{**kwargs, "seed": 8})
    assert [c.text for c in other_seed.choices] != [c.text for c in first.choices]


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text.strip().split()[2]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                           max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        top = [t.logprob for t in item.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert math.isclose(item.logprob, top[0], rel_tol=1e-5, abs_tol=1e-6), "greedy picks the top token"
        assert item.token == item.top_logprobs[0].token
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)


def test_prefix_cache_reported_in_usage(client):
    prompt = "Here is a long shared system prompt about the history of computing. " * 8
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_bad_inputs_then_still_correct(server, client):
    before = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    failures = run_bad_input_table(server.base_url, MODEL, API_KEY, MAX_MODEL_LEN)
    assert not failures, "\n".join(failures)
    after = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert after.choices[0].text == before.choices[0].text
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_metrics_idle_after_requests(server):
    values = wait_for_idle(server.base_url, idle_kv_usage=0.0)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:kv_cache_usage_perc"] == 0
    assert values["vllm:generation_tokens_total"] > 0
    assert values["vllm:time_to_first_token_seconds_count"] > 0
    assert values["vllm:prefix_cache_hits_total"] > 0
    assert 0 < values["kvserve_prefix_cache_hit_rate"] <= 1


# ----- load and disconnects (same server: one process per module) -----

LOAD_PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]


# A batch of many requests runs the panel GEMM (bfloat16) where one request alone runs the
# row kernel (int8 activations): the logits move by a few hundredths, so a greedy choice
# between two tokens this close (log-probability gap, nats) may go either way.
NEAR_TIE = 0.3


async def _expected_answers(aclient: openai.AsyncOpenAI, max_tokens: int) -> dict[str, tuple]:
    """Each prompt's greedy (text, token count, token strings, top-2 log-probabilities per
    token), asked alone and non-streaming before the load."""
    expected = {}
    for prompt in LOAD_PROMPTS:
        reply = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 logprobs=2)
        lp = reply.choices[0].logprobs
        expected[prompt] = (reply.choices[0].text, reply.usage.completion_tokens, lp.tokens, lp.top_logprobs)
    return expected


def _departs_at_near_tie(expected: tuple, text: str) -> bool:
    """Whether `text` departs from the expected answer first at a token whose two likeliest
    choices were within NEAR_TIE of each other in the expected run (the only place another
    kernel's rounding may change a greedy answer)."""
    want, _, tokens, top = expected
    common, at, k = len(os.path.commonprefix([want, text])), 0, 0
    while k < len(tokens) - 1 and at + len(tokens[k]) <= common and want[at:at + len(tokens[k])] == tokens[k]:
        at += len(tokens[k])
        k += 1
    best = sorted(top[k].values(), reverse=True)
    return len(best) >= 2 and best[0] - best[1] <= NEAR_TIE


async def _streaming_client(aclient: openai.AsyncOpenAI, client_index: int, num_requests: int,
                            max_tokens: int) -> list[tuple[str, str, int]]:
    results = []
    for request_index in range(num_requests):
        prompt = LOAD_PROMPTS[(client_index + request_index) % len(LOAD_PROMPTS)]
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        text, completion_tokens = "", -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
        results.append((prompt, text, completion_tokens))
    return results


def run_load(base_url: str, num_clients: int, num_requests: int, max_tokens: int = 6) -> None:
    import asyncio

    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
        expected = await _expected_answers(aclient, max_tokens)
        per_client = await asyncio.gather(*[
            _streaming_client(aclient, i, num_requests, max_tokens) for i in range(num_clients)])
        await aclient.close()
        return expected, [r for results in per_client for r in results]

    idle_kv_usage = metric_values(base_url)["vllm:kv_cache_usage_perc"]
    expected, results = asyncio.run(scenario())
    assert len(results) == num_clients * num_requests
    mismatches = [(p, t, n, expected[p][:2]) for p, t, n in results
                  if (t, n) != expected[p][:2] and not _departs_at_near_tie(expected[p], t)]
    assert not mismatches, mismatches[:5]
    values = wait_for_idle(base_url, idle_kv_usage)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:num_requests_waiting"] == 0
    assert values["vllm:kv_cache_usage_perc"] <= idle_kv_usage + 1e-9


def test_near_tie_rule_finds_the_token_where_an_answer_departs():
    # the expected run stopped at once (end of text 0.11 above a newline); another went on
    stopped = ("", 1, [""], [{"<|im_end|>": -1.26, "\n": -1.37}])
    assert _departs_at_near_tie(stopped, "\n\nThe number 7")
    sure = ("\n\nThe", 3, ["\n", "\n", "The"], [{"\n": -0.1, "A": -3.0}, {"\n": -0.2, "x": -2.0},
                                                    {"The": -1.0, "A": -1.2}])
    assert _departs_at_near_tie(sure, "\n\nA")  # the third token: a near-tie
    assert not _departs_at_near_tie(sure, "\nx")  # the second: not one
    assert not _departs_at_near_tie(sure, "")  # stopped at the first, which was clear


def test_concurrent_streaming_load(server):
    run_load(server.base_url, num_clients=16, num_requests=2)


@pytest.mark.slow
def test_concurrent_streaming_load_full(server):
    run_load(server.base_url, num_clients=64, num_requests=4)


def test_disconnects_abort_and_free_kv(server):
    import asyncio

    idle_kv_usage = metric_values(server.base_url)["vllm:kv_cache_usage_perc"]
    aborts_key = 'vllm:request_success_total{finished_reason="abort"}'
    aborts_before = metric_values(server.base_url).get(aborts_key, 0.0)
    num_clients = 20

    async def hang_up_mid_stream(http: httpx.AsyncClient, index: int) -> int:
        body = {"model": MODEL, "prompt": f"Tell me a very long story number {index}.",
                "max_tokens": 400, "stream": True, "ignore_eos": True}
        num_chunks = 0
        async with http.stream("POST", "/v1/completions", json=body,
                               headers={"authorization": f"Bearer {API_KEY}"}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                num_chunks += line.startswith("data: ")
                if num_chunks == 3:
                    break  # leaving the block closes the connection mid-stream
        return num_chunks

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            return await asyncio.gather(*[hang_up_mid_stream(http, i) for i in range(num_clients)])

    assert asyncio.run(scenario()) == [3] * num_clients
    values = wait_for_idle(server.base_url, idle_kv_usage)
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:kv_cache_usage_perc"] <= idle_kv_usage + 1e-9
    assert values[aborts_key] - aborts_before == num_clients


# ----- keep last: it stops the module's server -----

def test_sigterm_lets_an_in_flight_stream_finish(server):
    body = {"model": MODEL, "prompt": "Describe the sea.", "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True}
    data_lines = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {API_KEY}"}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data_lines.append(line)
            if len(data_lines) == 2:
                server.process.send_signal(signal.SIGTERM)
    assert data_lines[-1] == "data: [DONE]"
    finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in data_lines[:-1]]
    assert finish[-1] == "length" and finish.count("length") == 1
    server.process.wait(60)
    assert "server shut down cleanly" in server.log_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=5)
