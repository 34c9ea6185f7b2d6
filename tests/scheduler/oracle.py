"""What each request must produce, computed from the request alone.

`FakeModelRunner` samples a token that depends only on (request id,
position), so the whole output of a request follows from its sampling
parameters and the stop rules, however the scheduler batched, chunked,
preempted or pipelined it.
"""
from __future__ import annotations

from kvserve.request import Request
from kvserve.testing import FakeModelRunner, RequestResult, assert_pool_whole  # noqa: F401 - re-exported


def expected_result(runner: FakeModelRunner, request: Request, max_model_len: int) -> RequestResult:
    params = request.sampling_params
    prompt_len = len(request.prompt_token_ids)
    tokens: list[int] = []
    while True:
        token_id = runner.token_for(request.request_id, prompt_len + len(tokens), prompt_len)
        tokens.append(token_id)
        if len(tokens) >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                return RequestResult(tokens, "stop", None)
            if token_id in params.stop_token_ids:
                return RequestResult(tokens, "stop", token_id)
        if params.max_tokens is not None and len(tokens) >= params.max_tokens:
            return RequestResult(tokens, "length", None)
        if prompt_len + len(tokens) >= max_model_len:
            return RequestResult(tokens, "length", None)


def assert_results_match(runner: FakeModelRunner, requests: list[Request],
                         results: dict[str, RequestResult], max_model_len: int) -> None:
    for request in requests:
        expected = expected_result(runner, request, max_model_len)
        got = results[request.request_id]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.token_ids, expected.finish_reason, expected.stop_reason), request.request_id

