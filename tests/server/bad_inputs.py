"""A table of malformed and hostile requests, runnable against any kvserve server.

Each case states the HTTP status the OpenAI API contract asks for; every
error body must have the OpenAI shape. The same table runs against the
fake-engine server and the real one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class BadCase:
    name: str
    path: str
    body: bytes | dict | list | None
    status: int
    mentions: str = ""          # a word the error message must contain
    method: str = "POST"
    headers: dict = field(default_factory=dict)
    auth: bool = True           # send the right API key
    param: str | None = None    # the error's `param`, where the case pins it


def _user(content):
    return [{"role": "user", "content": content}]


def _bad_tool_cases(chat: dict) -> list[BadCase]:
    """Tool fields and tool turns that OpenAI refuses."""
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    turn = [*_user("Weather in Rome?"), {"role": "assistant", "content": None, "tool_calls": [call]}]
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    return [
        BadCase("tool parameters not a JSON schema", CHAT, {**chat, "tools": [bad_schema], "tool_choice": "auto"},
                400, "JSON schema", param="tools[0].function.parameters"),
        BadCase("two tools of one name", CHAT, {**chat, "tools": [weather, weather]}, 400, "unique",
                param="tools[1].function.name"),
        BadCase("tool message without tool_call_id", CHAT,
                {**chat, "messages": [*turn, {"role": "tool", "content": "sunny"}]}, 400, "tool_call_id",
                param="messages[2].tool_call_id"),
        BadCase("tool call arguments not a string", CHAT, {**chat, "messages": [
            *turn[:1], {"role": "assistant", "tool_calls": [{**call, "function": {"name": "weather", "arguments": {
                "city": "Rome"}}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}, 400,
                "arguments", param="messages[1].tool_calls[0].function.arguments"),
        BadCase("tool_choice names a function, no tools", CHAT,
                {**chat, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, 400, "tools",
                param="tool_choice"),
        BadCase("parallel_tool_calls not a bool", CHAT, {**chat, "tools": [weather], "parallel_tool_calls": "yes"},
                400, "bool", param="parallel_tool_calls"),
    ]


def bad_cases(model: str, max_model_len: int) -> list[BadCase]:
    ok_prompt = {"model": model, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": model, "messages": _user("Hello"), "max_tokens": 4}
    long_prompt = "hello " * (max_model_len + 16)
    return [
        BadCase("malformed json", COMPLETIONS, b'{"prompt": "hi", ', 400, "JSON"),
        BadCase("body is a list", COMPLETIONS, [1, 2, 3], 400),
        BadCase("missing prompt", COMPLETIONS, {"model": model, "max_tokens": 4}, 400, "prompt"),
        BadCase("prompt is a number", COMPLETIONS, {**ok_prompt, "prompt": 42}, 400, "prompt"),
        BadCase("empty prompt", COMPLETIONS, {**ok_prompt, "prompt": ""}, 400, "empty"),
        BadCase("max_tokens as string", COMPLETIONS, {**ok_prompt, "max_tokens": "16"}, 400, "max_tokens"),
        BadCase("negative max_tokens", COMPLETIONS, {**ok_prompt, "max_tokens": -5}, 400, "max_tokens"),
        BadCase("zero max_tokens", COMPLETIONS, {**ok_prompt, "max_tokens": 0}, 400, "max_tokens"),
        BadCase("huge max_tokens", COMPLETIONS, {**ok_prompt, "max_tokens": 10**9}, 400, str(max_model_len)),
        BadCase("negative temperature", COMPLETIONS, {**ok_prompt, "temperature": -1.0}, 400, "temperature"),
        BadCase("NaN temperature", COMPLETIONS,
                b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', 400, "temperature"),
        BadCase("top_p above 1", COMPLETIONS, {**ok_prompt, "top_p": 1.5}, 400, "top_p"),
        BadCase("n = 0", COMPLETIONS, {**ok_prompt, "n": 0}, 400, "n"),
        BadCase("n = one million", COMPLETIONS, {**ok_prompt, "n": 10**6}, 400, "n"),
        BadCase("300 prompts x n = 2", COMPLETIONS, {**ok_prompt, "prompt": ["hi"] * 300, "n": 2}, 400, "256"),
        BadCase("logprobs = 100", COMPLETIONS, {**ok_prompt, "logprobs": 100}, 400, "logprobs"),
        BadCase("empty stop string", COMPLETIONS, {**ok_prompt, "stop": [""]}, 400, "stop"),
        BadCase("presence_penalty 5", COMPLETIONS, {**ok_prompt, "presence_penalty": 5}, 400, "presence_penalty"),
        BadCase("seed beyond 64 bits", COMPLETIONS, {**ok_prompt, "seed": 2**70}, 400, "seed"),
        BadCase("token id out of vocab", COMPLETIONS, {**ok_prompt, "prompt": [1, 10**9]}, 400, "token id"),
        BadCase("negative token id", COMPLETIONS, {**ok_prompt, "prompt": [-1]}, 400, "token id"),
        BadCase("prompt over the context", COMPLETIONS, {**ok_prompt, "prompt": long_prompt}, 400,
                str(max_model_len)),
        BadCase("invalid UTF-8 body", COMPLETIONS, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}', 400),
        BadCase("10 MB body", COMPLETIONS, {**ok_prompt, "prompt": "a" * (10 * 1024 * 1024)}, 413),
        BadCase("unknown model", COMPLETIONS, {**ok_prompt, "model": "gpt-17"}, 404, "gpt-17"),
        BadCase("best_of", COMPLETIONS, {**ok_prompt, "best_of": 3}, 400, "best_of"),
        BadCase("suffix", COMPLETIONS, {**ok_prompt, "suffix": "end"}, 400, "suffix"),
        BadCase("stream_options without stream", COMPLETIONS,
                {**ok_prompt, "stream_options": {"include_usage": True}}, 400, "stream"),
        BadCase("empty messages", CHAT, {**chat, "messages": []}, 400, "messages"),
        BadCase("unknown role", CHAT, {**chat, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        BadCase("message without role", CHAT, {**chat, "messages": [{"content": "hi"}]}, 400, "role"),
        BadCase("content is a number", CHAT, {**chat, "messages": _user(7)}, 400, "content"),
        BadCase("image content", CHAT, {**chat, "messages": _user(
            [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])}, 400, "image_url"),
        BadCase("tools without a function", CHAT, {**chat, "tools": [{"type": "function"}]}, 400, "tools"),
        BadCase("tool_choice without tools", CHAT, {**chat, "tool_choice": "required"}, 400, "tool_choice"),
        *_bad_tool_cases(chat),
        BadCase("response_format xml", CHAT, {**chat, "response_format": {"type": "xml"}},
                400, "response_format"),
        BadCase("chat max_completion_tokens huge", CHAT, {**chat, "max_completion_tokens": 10**9}, 400,
                str(max_model_len)),
        BadCase("top_logprobs without logprobs", CHAT, {**chat, "top_logprobs": 3}, 400, "logprobs"),
        BadCase("form-encoded body", COMPLETIONS, b"prompt=hi&max_tokens=4", 400,
                headers={"content-type": "application/x-www-form-urlencoded"}),
        BadCase("GET on a POST route", COMPLETIONS, None, 405, method="GET"),
        BadCase("unknown route", "/v1/engines", {}, 404),
        BadCase("missing API key", COMPLETIONS, ok_prompt, 401, "API key", auth=False),
        BadCase("wrong API key", COMPLETIONS, ok_prompt, 401, "API key", auth=False,
                headers={"authorization": "Bearer not-the-key"}),
    ]


def send(client: httpx.Client, case: BadCase, api_key: str) -> httpx.Response:
    headers = {"content-type": "application/json", **case.headers}
    if case.auth:
        headers["authorization"] = f"Bearer {api_key}"
    if case.body is None:
        content = None
    elif isinstance(case.body, bytes):
        content = case.body
    else:
        content = json.dumps(case.body).encode()
    return client.request(case.method, case.path, content=content, headers=headers)


def check_error_shape(response: httpx.Response) -> dict:
    """The body is `{"error": {"message", "type", "param", "code"}}`; returns the error."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


def run_bad_input_table(base_url: str, model: str, api_key: str, max_model_len: int) -> list[str]:
    """Send every case; return a list of failures (empty when all behaved)."""
    failures = []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for case in bad_cases(model, max_model_len):
            response = send(client, case, api_key)
            if response.status_code != case.status:
                failures.append(f"{case.name}: status {response.status_code} != {case.status}: "
                                f"{response.text[:200]}")
                continue
            try:
                error = check_error_shape(response)
            except (AssertionError, ValueError) as exc:
                failures.append(f"{case.name}: bad error shape: {exc!r}")
                continue
            if case.mentions and case.mentions.lower() not in error["message"].lower():
                failures.append(f"{case.name}: message does not mention {case.mentions!r}: "
                                f"{error['message']!r}")
            if case.param is not None and error["param"] != case.param:
                failures.append(f"{case.name}: param {error['param']!r} != {case.param!r}")
    return failures
