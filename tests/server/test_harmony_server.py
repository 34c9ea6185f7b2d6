"""A tiny random gpt-oss behind the real server, through the official openai client:
harmony prompts, reasoning_content, tool calls, streamed and not.

What a random model writes is never pinned: each answer checked here is made certain by a
grammar (tool_choice `required` forces a call; `guided_grammar` forces the channels and the
reasoning text, leaving the model free where the check allows any value).
"""
from __future__ import annotations

import datetime
import json
import re
import signal

import httpx
import openai
import pytest
from helpers.harmony_model import harmony_tokenizer, save_tiny_gpt_oss
from helpers.server_process import ServerProcess

from kvserve.server.harmony import render_harmony
from kvserve.server.protocol import ChatMessage

MODEL = "gpt-oss-tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string", "enum": ["Paris"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                                       "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
# The channels and the reasoning fixed; the answer any 1 to 8 lowercase letters.
CHANNELS_GRAMMAR = ('start: <|channel|> "analysis" <|message|> "thinking it over" <|end|> '
                    '<|start|> "assistant" <|channel|> "final" <|message|> /[a-z]{1,8}/ <|return|>')
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")))
    process = ServerProcess("--model", path, "--served-model-name", MODEL, "--max-model-len", "1024",
                            "--kv-cache-memory", "16MiB")
    yield process
    assert process.stop() in (0, -signal.SIGTERM), process.log_text()
    process.remove_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(stream) -> tuple[str, str, list[list[str]], str]:
    """(reasoning, content, [[name, arguments]], finish reason) added up from a chat stream."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id:
                calls.append([call.function.name, ""])
            calls[call.index][1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_forced_call_is_a_tool_call(client):
    """The only call the grammar admits: its name and arguments, finish reason tool_calls."""
    response = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required",
                                              max_tokens=64, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="required",
                                            max_tokens=64, temperature=0, stream=True)
    assert _streamed(stream) == ("", "", [["get_weather", '{"city": "Paris"}']], "tool_calls")


def test_required_call_picks_one_of_the_tools(client):
    """With two tools the model picks one (not pinned); the arguments fit that tool's schema."""
    for seed in range(3):
        response = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME],
                                                  tool_choice="required", max_tokens=64, seed=seed)
        (call,) = response.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert arguments == {"city": "Paris"} if call.function.name == "get_weather" else \
            (call.function.name == "get_time" and set(arguments) == {"zone"} and 0 <= arguments["zone"] <= 9)


def test_reasoning_content_and_answer(client):
    response = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, temperature=0,
                                              extra_body={"guided_grammar": CHANNELS_GRAMMAR})
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "thinking it over"
    assert re.fullmatch("[a-z]{1,8}", message.content) and not message.tool_calls
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=64, temperature=0.8, seed=3,
                                            extra_body={"guided_grammar": CHANNELS_GRAMMAR}, stream=True)
    reasoning, content, calls, finish = _streamed(stream)
    assert (reasoning, calls, finish) == ("thinking it over", [], "stop")
    assert re.fullmatch("[a-z]{1,8}", content)


def test_cut_off_inside_the_reasoning(client):
    """max_tokens 12: <|channel|>, "analysis" (8 byte tokens), <|message|> and "th"."""
    response = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0,
                                              extra_body={"guided_grammar": CHANNELS_GRAMMAR})
    choice = response.choices[0]
    assert (choice.finish_reason, choice.message.model_extra["reasoning_content"], choice.message.content) == \
        ("length", "th", "")


def test_prompt_is_the_harmony_rendering(server, client):
    """A follow-up after a tool call: the server's prompt is `render_harmony`'s text, tokenized;
    /tokenize renders the same conversation without the tools' text and at the default effort."""
    messages = [{"role": "system", "content": "Be brief."}, *USER,
                {"role": "assistant", "reasoning_content": "Call it.", "content": None, "tool_calls": [
                    {"id": "call_9", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]
    days = {datetime.date.today()}
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=1,
                                              reasoning_effort="low")
    tokenized = httpx.post(server.base_url + "/tokenize", timeout=60, json={"messages": messages}).json()
    days.add(datetime.date.today())  # the server renders today's date: either day around midnight
    tokenizer = harmony_tokenizer()
    expected = {len(tokenizer.encode(render_harmony([ChatMessage(**m) for m in messages], [WEATHER], "low",
                                                    today=day), add_special_tokens=False)) for day in days}
    assert response.usage.prompt_tokens in expected
    assert tokenized["tokens"] in [tokenizer.encode(render_harmony([ChatMessage(**m) for m in messages], None, None,
                                                                   today=day), add_special_tokens=False)
                                   for day in days]


def test_bad_reasoning_effort_is_a_400(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": USER, "reasoning_effort": "extreme"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "reasoning_effort"


def test_responses_and_messages_apis_get_the_call(server, client):
    """The other chat APIs read harmony replies too (their reasoning is not passed on)."""
    function = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[function],
                                       tool_choice="required", max_output_tokens=64)
    assert [(item.type, item.name, json.loads(item.arguments)) for item in response.output] == \
        [("function_call", "get_weather", {"city": "Paris"})]
    answer = httpx.post(server.base_url + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 64, "messages": USER, "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]}).json()
    assert [(block["type"], block["name"], block["input"]) for block in answer["content"]] == \
        [("tool_use", "get_weather", {"city": "Paris"})]
    assert answer["stop_reason"] == "tool_use"
