"""The OpenAI Responses API on the real server (default model), through the official openai client.

Oracles: the chat template rendered here (the prompt the translation must build, checked
through `usage.input_tokens`), the server's own /v1/chat/completions on the equivalent
messages, jsonschema for tool arguments and JSON output, and the client's own stream
accumulator. What the model writes is pinned only where a grammar makes it certain.
"""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from helpers.server_process import running_server

from kvserve.engine.tokenizer import apply_chat_template

from .conftest import metric_values, wait_for_idle

MODEL = "smollm2"
API_KEY = "sk-responses"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
                "parameters": CITY_SCHEMA, "strict": True}
YES_FORMAT = {"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"enum": ["yes"]}}, "required": ["answer"],
    "additionalProperties": False}}}
# A format whose only answer is far longer than a few tokens: cut by max_output_tokens for certain.
LONG_FORMAT = {"format": {"type": "json_schema", "name": "long", "schema": {
    "type": "object", "properties": {"text": {"enum": ["alpha beta gamma delta epsilon zeta eta theta iota kappa"]}},
    "required": ["text"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", API_KEY, "--served-model-name", MODEL, "--max-model-len", "1024",
                        "--kv-cache-memory", "64MiB") as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def prompt_len(tokenizer, messages) -> int:
    return len(apply_chat_template(tokenizer, messages))


def test_text_input_with_instructions(client, tokenizer):
    reply = client.responses.create(model=MODEL, input="Is water wet?", instructions="Answer in JSON.",
                                    text=YES_FORMAT, temperature=0, max_output_tokens=30)
    assert reply.status == "completed" and reply.incomplete_details is None
    assert json.loads(reply.output_text) == {"answer": "yes"}
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].text == reply.output_text
    expected = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Is water wet?"}]
    assert reply.usage.input_tokens == prompt_len(tokenizer, expected)
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.instructions == "Answer in JSON." and reply.model == MODEL


def test_message_list_input(client, tokenizer):
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "!"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "user", "content": "Is the sky blue?"}]
    reply = client.responses.create(model=MODEL, input=items, text=YES_FORMAT, temperature=0, max_output_tokens=30)
    expected = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Is the sky blue?"}]
    assert reply.usage.input_tokens == prompt_len(tokenizer, expected)
    assert json.loads(reply.output_text) == {"answer": "yes"}


def test_previous_response_id_continues_the_conversation(client, tokenizer):
    first = client.responses.create(model=MODEL, input="Is fire hot? Answer at length, please.", text=YES_FORMAT,
                                    temperature=0, max_output_tokens=30)
    second = client.responses.create(model=MODEL, input="And ice?", previous_response_id=first.id,
                                     text=YES_FORMAT, temperature=0, max_output_tokens=30)
    expected = [{"role": "user", "content": "Is fire hot? Answer at length, please."},
                {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And ice?"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_len(tokenizer, expected)
    # The first call's prompt is a prefix of the second's: its full blocks come from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens > 0
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, text=YES_FORMAT, max_output_tokens=30)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id, max_output_tokens=4)


def test_stream_events_in_order_and_accumulated_text(client):
    with client.responses.stream(model=MODEL, input="Is water wet?", text=YES_FORMAT, temperature=0,
                                 max_output_tokens=30) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas
    expected = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                "response.output_text.done", "response.content_part.done", "response.output_item.done",
                "response.completed"]
    assert types == expected
    assert "".join(deltas) == final.output_text == events[-4].text
    assert json.loads(final.output_text) == {"answer": "yes"}
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_stream_cut_by_max_output_tokens_ends_incomplete(client):
    with client.responses.stream(model=MODEL, input="Go", text=LONG_FORMAT, max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 3
    assert final.output[0].status == "incomplete"
    reply = client.responses.create(model=MODEL, input="Go", text=LONG_FORMAT, max_output_tokens=3)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"


def test_forced_function_call(client):
    reply = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    assert reply.status == "completed"
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), CITY_SCHEMA)


def test_streamed_function_call_matches_its_done_events(client):
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL],
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert call.arguments == deltas == events[-3].arguments
    assert events[2].item.call_id == call.call_id
    jsonschema.validate(json.loads(call.arguments), CITY_SCHEMA)


def test_tool_round_with_function_call_output(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=60)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                      tools=[WEATHER_TOOL], text=YES_FORMAT, max_output_tokens=30)
    stateless = client.responses.create(
        model=MODEL, tools=[WEATHER_TOOL], text=YES_FORMAT, max_output_tokens=30,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               result])
    # The same conversation through Chat Completions renders the same prompt.
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=1, tools=[{"type": "function", "function": {
            k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [{
                      "id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])
    assert chained.usage.input_tokens == stateless.usage.input_tokens == chat.usage.prompt_tokens
    assert json.loads(chained.output_text) == json.loads(stateless.output_text) == {"answer": "yes"}
    with pytest.raises(openai.BadRequestError):  # a call without its output
        client.responses.create(model=MODEL, max_output_tokens=4, input=[
            {"role": "user", "content": "Hi"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}])


def test_json_object_format(client):
    reply = client.responses.create(model=MODEL, input="A JSON object please", max_output_tokens=40,
                                    text={"format": {"type": "json_object"}}, temperature=0)
    if reply.status == "completed":
        assert isinstance(json.loads(reply.output_text), dict)
    else:  # the model may write a longer object than 40 tokens: then it is cut, inside an object
        assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 40
        assert reply.output_text.lstrip().startswith("{")


def test_background_cancel_retrieve_delete(server, client):
    idle_kv_usage = metric_values(server.base_url)["vllm:kv_cache_usage_perc"]
    # At least 2000 characters of one string: still running when the cancel arrives.
    long_text = {"format": {"type": "json_schema", "name": "t", "schema": {
        "type": "object", "properties": {"t": {"type": "string", "minLength": 2000}}, "required": ["t"]}}}
    started = client.responses.create(model=MODEL, input="Write", background=True, text=long_text,
                                      max_output_tokens=900)
    assert started.status == "in_progress" and started.background
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(started.id).status == "cancelled"
    values = wait_for_idle(server.base_url, idle_kv_usage)
    assert values["vllm:num_requests_running"] == 0
    done = client.responses.create(model=MODEL, input="Is water wet?", background=True, text=YES_FORMAT,
                                   max_output_tokens=30)
    for _ in range(600):
        polled = client.responses.retrieve(done.id)
        if polled.status != "in_progress":
            break
        time.sleep(0.1)
    assert polled.status == "completed" and json.loads(polled.output_text) == {"answer": "yes"}
    assert client.responses.cancel(done.id).status == "completed"  # finished: returned unchanged
    sync = client.responses.create(model=MODEL, input="Hi", text=YES_FORMAT, max_output_tokens=30)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(sync.id)
    assert client.responses.retrieve(sync.id).id == sync.id
    client.responses.delete(sync.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(sync.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(sync.id)


def _deep_content(depth: int) -> dict:
    part: dict = {"type": "input_text", "text": "x"}
    for _ in range(depth):
        part = {"type": "input_text", "text": part}
    return part


def _deeply_nested_body(depth: int) -> bytes:
    """`input` parts nested `depth` levels deep, written directly (json.dumps would recurse)."""
    opening = '{"type": "input_text", "text": ' * depth
    return ('{"max_output_tokens": 4, "input": [{"role": "user", "content": [' + opening + '"x"' + "}" * depth
            + "]}]}").encode()


HOSTILE = [
    ("huge input list", {"input": [{"role": "user", "content": "hi"}] * 20000}, 400),
    ("deep JSON nesting", _deeply_nested_body(5000), 400),
    ("nested part as text", {"input": [{"role": "user", "content": [_deep_content(3)]}]}, 400),
    ("unknown item type", {"input": [{"type": "computer_call", "action": {}}]}, 400),
    ("image part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400),
    ("unknown role", {"input": [{"role": "wizard", "content": "hi"}]}, 400),
    ("empty input list", {"input": []}, 400),
    ("input a number", {"input": 7}, 400),
    ("web search tool", {"input": "hi", "tools": [{"type": "web_search"}]}, 400),
    ("bad text format", {"input": "hi", "text": {"format": {"type": "xml"}}}, 400),
    ("json_schema without name", {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400),
    ("tool_choice names no tool", {"input": "hi", "tools": [WEATHER_TOOL],
                                   "tool_choice": {"type": "function", "name": "nope"}}, 400),
    ("negative max_output_tokens", {"input": "hi", "max_output_tokens": -1}, 400),
    ("unknown model", {"input": "hi", "model": "gpt-17"}, 404),
]


@pytest.mark.parametrize("name, body, status", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_inputs_get_openai_errors(server, name, body, status):
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL, "max_output_tokens": 4, **body}).encode()
    response = httpx.post(server.base_url + "/v1/responses", content=content, timeout=60,
                          headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_lone_surrogates_and_missing_key_then_healthy(server, client):
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    for raw in (b'{"input": "\\ud800 hi", "max_output_tokens": 4}', b'{"input": "\xed\xa0\x80", "max_output_tokens": 4}'):
        response = httpx.post(server.base_url + "/v1/responses", content=raw, headers=headers, timeout=60)
        assert response.status_code == 400 and "error" in response.json()
    response = httpx.post(server.base_url + "/v1/responses", json={"input": "hi"}, timeout=60)
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    reply = client.responses.create(model=MODEL, input="Is water wet?", text=YES_FORMAT, max_output_tokens=30)
    assert json.loads(reply.output_text) == {"answer": "yes"}
