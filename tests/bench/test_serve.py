"""The serving benchmark measured against a fake SSE server whose timings and counts are known."""
from __future__ import annotations

import pytest

from kvserve.bench.serve import NotLoopbackError, ServeBenchConfig, run

from .fake_openai_server import FakeServer

FIRST_TOKEN_DELAY_S = 0.05
INTER_TOKEN_DELAY_S = 0.01
NUM_TOKENS = 6


def fake_server(**overrides) -> FakeServer:
    options = dict(num_tokens=NUM_TOKENS, first_token_delay_s=FIRST_TOKEN_DELAY_S,
                   inter_token_delay_s=INTER_TOKEN_DELAY_S)
    options.update(overrides)
    return FakeServer(**options)


def test_fixed_concurrency_measures_what_the_server_sent():
    with fake_server() as server:
        result = run(ServeBenchConfig(base_url=server.url, num_prompts=12, prompt_words=8, max_tokens=NUM_TOKENS,
                                      concurrency=4))
    log = server.log
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["output_tokens"] == log.tokens_sent == 12 * NUM_TOKENS
    assert log.max_open_streams == 4
    assert result["config"]["model"] == "fake-model"
    assert all(body["stream"] and body["max_tokens"] == NUM_TOKENS and body["ignore_eos"] for body in log.bodies)
    assert len({body["prompt"] for body in log.bodies}) == 12
    assert FIRST_TOKEN_DELAY_S <= result["ttft"]["p50_ms"] / 1000 < FIRST_TOKEN_DELAY_S + 0.5
    assert INTER_TOKEN_DELAY_S * 0.8 <= result["itl"]["p50_ms"] / 1000 < INTER_TOKEN_DELAY_S + 0.2
    assert result["itl"]["count"] == 12 * (NUM_TOKENS - 1)
    min_e2e_s = FIRST_TOKEN_DELAY_S + (NUM_TOKENS - 1) * INTER_TOKEN_DELAY_S
    assert result["e2e"]["p50_ms"] / 1000 >= min_e2e_s * 0.95
    assert result["tpot"]["p50_ms"] == pytest.approx(
        (result["e2e"]["p50_ms"] - result["ttft"]["p50_ms"]) / (NUM_TOKENS - 1), rel=0.5)
    assert result["output_token_throughput"] == pytest.approx(result["output_tokens"] / result["duration_s"])
    # Three waves of four requests at least.
    assert result["duration_s"] >= 3 * min_e2e_s * 0.95


def test_failures_are_counted_and_the_rest_measured():
    with fake_server(fail_request_numbers=frozenset({1, 4})) as server:
        result = run(ServeBenchConfig(base_url=server.url, num_prompts=8, prompt_words=4, max_tokens=NUM_TOKENS,
                                      concurrency=2))
    assert result["completed"] == 6 and result["failed"] == 2
    assert result["errors"][0]["count"] == 2 and "HTTP 500" in result["errors"][0]["error"]
    assert result["output_tokens"] == server.log.tokens_sent == 6 * NUM_TOKENS


def test_poisson_rate_spreads_arrivals_and_chat_endpoint_without_usage_counts_chunks():
    with fake_server(send_usage=False) as server:
        result = run(ServeBenchConfig(base_url=server.url, endpoint="chat", num_prompts=10, prompt_words=4,
                                      max_tokens=NUM_TOKENS, concurrency=None, request_rate=20.0, seed=3))
    log = server.log
    assert result["completed"] == 10
    assert all(body["messages"][0]["role"] == "user" for body in log.bodies)
    assert result["output_tokens"] == log.tokens_sent
    # Nine exponential gaps at 20 req/s sum to about 0.45 s; under 0.1 s has probability ~2e-4.
    assert log.arrival_times[-1] - log.arrival_times[0] > 0.1


def test_the_run_is_written_as_a_trace_that_plan_reads(tmp_path):
    from kvserve.planner.trace import read_trace

    path = tmp_path / "serve.trace.jsonl"
    with fake_server(fail_request_numbers=frozenset({2})) as server:
        result = run(ServeBenchConfig(base_url=server.url, num_prompts=6, prompt_words=4, max_tokens=NUM_TOKENS,
                                      concurrency=None, request_rate=30.0, seed=1, trace_out=str(path)))
    trace = read_trace(result["trace_path"])
    assert len(trace) == 5  # the failed request is left out
    assert all(r.output_len == NUM_TOKENS and r.prompt_len > 0 and r.prefix_id is None for r in trace)
    received = sorted(server.log.arrival_times)
    # Send times are offsets from the start of the run, spread as the server saw the requests
    # arrive (give or take the loopback latency of a loaded machine).
    assert trace[0].arrival_s < 0.5
    assert trace[-1].arrival_s - trace[0].arrival_s == pytest.approx(received[-1] - received[0], abs=0.5)


def test_non_loopback_urls_are_refused():
    with pytest.raises(NotLoopbackError):
        ServeBenchConfig(base_url="http://example.com:8000")
    ServeBenchConfig(base_url="http://localhost:8000")
    ServeBenchConfig(base_url="http://[::1]:8000/v1")
