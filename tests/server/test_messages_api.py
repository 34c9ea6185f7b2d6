"""The Anthropic Messages API on the real server (default model), through the official anthropic client.

Oracles: the chat template rendered here (through the usage counts), the server's own
/v1/chat/completions on the equivalent messages, jsonschema for tool inputs, and the
client's own stream accumulator. What the model writes is pinned only where a grammar
(`output_config.format`, a forced tool) makes it certain. This client version has no
`temperature` argument: sampling fields go in `extra_body`.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from helpers.server_process import running_server

from kvserve.engine.tokenizer import apply_chat_template

MODEL = "smollm2"
API_KEY = "sk-messages"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather of a city", "input_schema": CITY_SCHEMA}
GREEDY = {"temperature": 0}


def enum_format(*values: str) -> dict:
    """`output_config` whose only answers are `{"answer": <one of values>}`."""
    return {"format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"answer": {"enum": list(values)}}, "required": ["answer"],
        "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", API_KEY, "--served-model-name", MODEL, "--max-model-len", "1024",
                        "--kv-cache-memory", "64MiB") as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_with_system_blocks(client, tokenizer):
    reply = client.messages.create(model=MODEL, max_tokens=30, system=[{"type": "text", "text": "Answer in JSON."}],
                                   messages=user("Is water wet?"), output_config=enum_format("yes"),
                                   extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    [block] = reply.content
    assert block.type == "text" and json.loads(block.text) == {"answer": "yes"}
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    expected = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Is water wet?"}]
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(apply_chat_template(tokenizer, expected))
    assert usage.output_tokens > 0


def test_prefix_cache_read_tokens(client):
    messages = user("Tell me about the history of the city of Paris, in many details, please. " * 3)
    first = client.messages.create(model=MODEL, max_tokens=1, messages=messages)
    second = client.messages.create(model=MODEL, max_tokens=1, messages=messages)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    # The second prompt's full blocks were all cached by the first (at least one block is full).
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_read_input_tokens >= first.usage.cache_read_input_tokens


def test_max_tokens_stop_reason(client):
    reply = client.messages.create(model=MODEL, max_tokens=3, messages=user("Go"),
                                   output_config=enum_format("alpha beta gamma delta epsilon zeta eta theta"))
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 3


def test_stream_text_equals_final_message(client):
    with client.messages.stream(model=MODEL, max_tokens=30, messages=user("Is water wet?"),
                                output_config=enum_format("yes"), extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text and json.loads(streamed) == {"answer": "yes"}
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_stream_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 30, "stream": True, "messages": user("Is water wet?"),
            "output_config": enum_format("yes")}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("data: ")]
    assert [p["type"] for p in payloads] == names
    num_deltas = names.count("content_block_delta")
    assert num_deltas > 0
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert payloads[0]["message"]["content"] == [] and payloads[0]["message"]["stop_reason"] is None
    assert payloads[-2]["delta"]["stop_reason"] == "end_turn"


def test_tool_choice_any_gives_a_schema_valid_tool_use(client):
    reply = client.messages.create(model=MODEL, max_tokens=60, messages=user("What is the weather in Paris?"),
                                   tools=[WEATHER_TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert reply.stop_reason == "tool_use"
    [block] = reply.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, CITY_SCHEMA)
    # Parallel calls allowed: every call the model writes fits the schema.
    reply = client.messages.create(model=MODEL, max_tokens=60, messages=user("What is the weather in Paris?"),
                                   tools=[WEATHER_TOOL], tool_choice={"type": "any"})
    assert reply.stop_reason in ("tool_use", "max_tokens")
    for block in reply.content:
        assert block.type == "tool_use"
        jsonschema.validate(block.input, CITY_SCHEMA)


def test_streamed_tool_use(client):
    with client.messages.stream(model=MODEL, max_tokens=60, messages=user("Weather in Rome?"), tools=[WEATHER_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [block] = final.content
    assert block.type == "tool_use"
    jsonschema.validate(block.input, CITY_SCHEMA)


def test_tool_result_round(client):
    first = client.messages.create(model=MODEL, max_tokens=60, messages=user("What is the weather in Paris?"),
                                   tools=[WEATHER_TOOL],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    [call] = first.content
    messages = [*user("What is the weather in Paris?"), {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    second = client.messages.create(model=MODEL, max_tokens=30, messages=messages, tools=[WEATHER_TOOL],
                                    output_config=enum_format("yes"))
    assert json.loads(second.content[0].text) == {"answer": "yes"} and second.stop_reason == "end_turn"
    chat = httpx.post(client.base_url.join("/v1/chat/completions").__str__(), headers={"x-api-key": API_KEY},
                      timeout=120, json={
                          "model": MODEL, "max_tokens": 1,
                          "tools": [{"type": "function", "function": {
                              "name": "get_weather", "description": WEATHER_TOOL["description"],
                              "parameters": CITY_SCHEMA}}],
                          "messages": [*user("What is the weather in Paris?"),
                                       {"role": "assistant", "content": None, "tool_calls": [{
                                           "id": call.id, "type": "function", "function": {
                                               "name": call.name, "arguments": json.dumps(call.input)}}]},
                                       {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]}).json()
    usage = second.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_stop_sequences(client):
    reply = client.messages.create(model=MODEL, max_tokens=40, messages=user("Say it"), stop_sequences=["beta"],
                                   output_config=enum_format("alpha beta gamma"))
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "beta"
    text = reply.content[0].text  # the grammar's only answer, cut before the stop sequence
    assert text.replace(" ", "") == '{"answer":"alpha' and text.endswith("alpha ")


def test_prefill_continues_the_last_assistant_turn(client, tokenizer):
    messages = [*user("Is water wet?"), {"role": "assistant", "content": '{"answer": '}]
    reply = client.messages.create(model=MODEL, max_tokens=10, messages=messages)
    prompt = apply_chat_template(tokenizer, user("Is water wet?")) + tokenizer.encode('{"answer": ',
                                                                                      add_special_tokens=False)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)


def test_count_tokens_matches_the_prompt(client, tokenizer):
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=user("Hello there"))
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert counted.input_tokens == len(apply_chat_template(tokenizer, expected))


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=-5, messages=user("Hi"))
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    keyless = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        keyless.messages.create(model=MODEL, max_tokens=5, messages=user("Hi"))
    assert denied.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "invalid API key"}}
    response = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL, "max_tokens": 5,
                                                                  "messages": user("Hi")}, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-9", max_tokens=5, messages=user("Hi"))
    assert missing.value.body["error"]["type"] == "not_found_error"
    bearer = httpx.post(server.base_url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": user("Hi")},
                        headers={"authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0


def _nested_tool_result(depth: int) -> bytes:
    opening = '{"type": "tool_result", "tool_use_id": "t", "content": [' * depth
    return ('{"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": ['
            + opening + '{"type": "text", "text": "x"}' + "]}" * depth + "]}]}").encode()


HOSTILE = [
    ("huge message list", {"messages": user("hi") * 20000}, 400),
    ("deep block nesting", _nested_tool_result(5000), 400),
    ("tool_result inside tool_result", _nested_tool_result(3), 400),
    ("unknown block type", {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400),
    ("image block", {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
    ("tool_result without a tool_use", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}, 400),
    ("unknown role", {"messages": [{"role": "system", "content": "hi"}]}, 400),
    ("missing max_tokens", {"max_tokens": None}, 400),
    ("temperature above 1", {"temperature": 1.5}, 400),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, 400),
    ("tool_choice any without tools", {"tool_choice": {"type": "any"}}, 400),
    ("bad tool schema", {"tools": [{"name": "f", "input_schema": {"type": "objekt"}}]}, 400),
    ("prompt over the context", {"messages": user("hello " * 3000)}, 400),
    ("10 MB body", {"messages": user("a" * (10 * 1024 * 1024))}, 413),
]


@pytest.mark.parametrize("name, body, status", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_inputs_get_anthropic_errors(server, name, body, status):
    if isinstance(body, bytes):
        content = body
    else:
        fields = {"model": MODEL, "max_tokens": 4, "messages": user("hi"), **body}
        content = json.dumps({k: v for k, v in fields.items() if v is not None}).encode()
    response = httpx.post(server.base_url + "/v1/messages", content=content, timeout=60,
                          headers={"x-api-key": API_KEY, "content-type": "application/json"})
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload
    assert payload["error"]["message"]


def test_lone_surrogates_then_healthy(server, client):
    headers = {"x-api-key": API_KEY, "content-type": "application/json"}
    for text in (b'"\\udc00 hi"', b'"\xed\xb0\x80"'):
        raw = b'{"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": ' + text + b"}]}"
        response = httpx.post(server.base_url + "/v1/messages", content=raw, headers=headers, timeout=60)
        assert response.status_code == 400 and response.json()["type"] == "error"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    reply = client.messages.create(model=MODEL, max_tokens=30, messages=user("Hi"), output_config=enum_format("yes"))
    assert json.loads(reply.content[0].text) == {"answer": "yes"}
