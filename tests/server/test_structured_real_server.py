"""Structured output, tools, logit_bias and /tokenize against the real server (default model),
through the official openai client; outputs checked with pydantic / jsonschema / re.

What the model chooses to write is never pinned: each schema here bounds every string and
number, so a `max_tokens` of `BOUNDED_OUTPUT_TOKENS` fits the longest output it allows and
the grammar, not the model, decides that the request ends with "stop" (or "tool_calls");
"length" is asked for with `ignore_eos`."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from helpers.server_process import ServerProcess
from pydantic import BaseModel, Field
from typing import Literal

MODEL = "smollm2"
# The longest output the schemas here allow, in tokens: a string of maxLength 20 is at most
# 20 x 12 (a character outside the BMP written as a surrogate-pair escape, \uXXXX\uXXXX, one
# token a byte), an integer of at most 150 three; the JSON around them and a tool call's
# wrapper are well under 80 tokens.
BOUNDED_OUTPUT_TOKENS = 20 * 12 + 80
ALWAYS_LENGTH = {"ignore_eos": True}  # with max_tokens=2: certainly "length"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--served-model-name", MODEL, "--max-model-len", "1024", "--kv-cache-memory", "64MiB")
    yield process
    process.stop()
    process.remove_log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "Describe a person as JSON."}])
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, **kwargs)


class CityFacts(BaseModel):
    continent: Literal["Africa", "America", "Asia", "Europe", "Oceania"]
    capital: bool
    population: int


CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lyon", "Tokyo", "Osaka", "Cairo", "Lagos", "Sydney",
          "Toronto", "Ottawa", "Lima", "Quito", "Oslo", "Bergen", "Munich", "Delhi", "Mumbai", "Seoul"]


def test_parse_finishes_within_40_tokens_for_20_prompts(client, tokenizer):
    """The grammar bounds every free part of CityFacts: the enum and the boolean are a choice
    among fixed texts, the integer has at most 19 digits (int64's bound, with no bound in the
    schema), no whitespace is free and no other key can appear. So the longest output the
    grammar allows, in this tokenizer's tokens (one per digit) plus EOS, fits 40 tokens: which
    of them the model picks does not matter. (Before the bound the model wrote digits until
    max_tokens; the fixed texts are assumed written in the tokenizer's own tokens, as a model
    trained on them does.)"""
    assert len(tokenizer.encode("1" * 19, add_special_tokens=False)) == 19
    longest = max(len(tokenizer.encode(json.dumps({"continent": c, "capital": b, "population": 10 ** 18}),
                                       add_special_tokens=False))
                  for c in CityFacts.model_json_schema()["properties"]["continent"]["enum"] for b in (True, False))
    assert longest + 1 <= 40
    for city in CITIES:
        reply = client.beta.chat.completions.parse(
            model=MODEL, response_format=CityFacts, max_tokens=40, temperature=0,
            messages=[{"role": "user", "content": f"Describe {city} as JSON: its continent, whether it is a "
                                                  "capital, its population."}])
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (city, choice.message.content)
        assert reply.usage.completion_tokens <= 40
        assert isinstance(choice.message.parsed, CityFacts)
        assert list(json.loads(choice.message.content)) == ["continent", "capital", "population"]


def test_strict_schema_breaking_openai_rules_is_a_400(client):
    plain = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
    with pytest.raises(openai.BadRequestError, match="additionalProperties"):
        chat(client, response_format={"type": "json_schema",
                                      "json_schema": {"name": "p", "schema": plain, "strict": True}})
    reply = chat(client, max_tokens=BOUNDED_OUTPUT_TOKENS, response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {**plain, "additionalProperties": False}, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    assert set(json.loads(reply.choices[0].message.content)) == {"name"}


def test_parse_with_a_pydantic_model(client):
    reply = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "A person as JSON"}], response_format=Person,
        max_tokens=BOUNDED_OUTPUT_TOKENS, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Person)
    assert reply.choices[0].finish_reason == "stop"


def test_json_object_regex_choice_grammar_and_legacy_names(server, client):
    # Any object is allowed, of any length: only its first character is certain ...
    free = chat(client, messages=[{"role": "user", "content": "JSON please"}],
                response_format={"type": "json_object"}, max_tokens=40)
    assert free.choices[0].message.content.startswith("{")
    if free.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(free.choices[0].message.content), dict)
    else:
        assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 40
    # ... and where "{}" (one token) outweighs every other: the object closes, the grammar
    # then allows only the end of the sequence.
    (braces,) = httpx.post(server.base_url + "/tokenize", json={"prompt": "{}", "add_special_tokens": False}
                           ).json()["tokens"]
    closed = chat(client, messages=[{"role": "user", "content": "JSON please"}],
                  response_format={"type": "json_object"}, max_tokens=40, logit_bias={str(braces): 100})
    assert closed.choices[0].finish_reason == "stop"
    assert json.loads(closed.choices[0].message.content) == {}
    regex = chat(client, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, max_tokens=12)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].message.content)
    choice = chat(client, extra_body={"guided_choice": ["cat", "dog"]}, max_tokens=5)
    assert choice.choices[0].message.content in ("cat", "dog")
    grammar = chat(client, extra_body={"guided_grammar": 'root ::= "(" [a-z] ")"'}, max_tokens=8)
    assert re.fullmatch(r"\([a-z]\)", grammar.choices[0].message.content)
    schema = Person.model_json_schema()
    legacy = chat(client, extra_body={"guided_json": schema}, max_tokens=BOUNDED_OUTPUT_TOKENS)
    assert legacy.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(legacy.choices[0].message.content), schema)
    completion = client.completions.create(model=MODEL, prompt="Colour:", max_tokens=5, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert completion.choices[0].text in ("red", "blue")


def test_streamed_json_schema_adds_up_to_valid_json(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}},
              "required": ["colour"], "additionalProperties": False}
    stream = chat(client, stream=True, max_tokens=BOUNDED_OUTPUT_TOKENS, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_named_and_required_tool_choice_are_enforced(client):
    for tool_choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        reply = chat(client, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice,
                     parallel_tool_calls=False, max_tokens=BOUNDED_OUTPUT_TOKENS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.id and call.type == "function"
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"


def test_auto_and_none_and_a_tool_result_turn(client):
    auto = chat(client, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="auto")
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Ten tokens of text, whatever they say (even a tool call's tags): never parsed as a call.
    none = chat(client, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=10,
                extra_body=ALWAYS_LENGTH)
    assert none.choices[0].finish_reason == "length" and none.usage.completion_tokens == 10
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)
    turn = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    answer = chat(client, messages=turn, tools=[WEATHER_TOOL], max_tokens=30).choices[0]
    # The model may answer in text or call the tool again: either is a well-formed reply.
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    if answer.finish_reason == "tool_calls":
        assert answer.message.tool_calls


def test_streamed_tool_call_sends_id_and_name_then_arguments(client):
    stream = chat(client, messages=ASK_WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
                  parallel_tool_calls=False, stream=True, max_tokens=BOUNDED_OUTPUT_TOKENS)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    arguments = "".join(c.function.arguments or "" for c in calls[1:])
    assert all(c.id is None for c in calls[1:])
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])
    assert deltas[-1].finish_reason == "tool_calls"


def test_logit_bias_and_tokenize_detokenize(server, client):
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": " banana", "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    (banana,) = tokens["tokens"][:1]
    reply = chat(client, max_tokens=3, logit_bias={str(banana): 100})
    assert reply.choices[0].message.content.startswith(" banana banana")
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": " banana"}
    chat_tokens = httpx.post(server.base_url + "/tokenize",
                             json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tokens["count"] > 3


@pytest.mark.parametrize("body, param", [
    ({"extra": {"guided_regex": "[a-"}}, "guided_regex"),
    ({"extra": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}},
     "response_format.json_schema"),
    ({"extra": {"structured_outputs": {"grammar": "root ::= nothing_defined"}}}, "structured_outputs"),
    ({"extra": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"extra": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice"),
    ({"extra": {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}},
     "tool_choice"),
    ({"extra": {"tools": [{"type": "function"}]}}, "tools[0]"),
    ({"extra": {"logit_bias": {"99999999": 1}}}, "logit_bias"),
    ({"extra": {"response_format": {"type": "xml"}}}, "response_format.type"),
])
def test_bad_constraints_are_400_naming_the_parameter_and_the_server_stays_healthy(server, client, body, param):
    reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body["extra"]})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert chat(client, max_tokens=2, extra_body=ALWAYS_LENGTH).choices[0].finish_reason == "length"


def test_tool_fields_and_turns_openai_refuses_are_400_through_the_openai_client(server, client):
    """What the official client sends as given and OpenAI refuses: each a BadRequestError naming
    the parameter; the server keeps answering."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    not_a_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                  "properties": {"x": 5}}}}
    cases = [
        (dict(tools=[WEATHER_TOOL, not_a_schema], tool_choice="auto"), "tools[1].function.parameters"),
        (dict(tools=[WEATHER_TOOL, TIME_TOOL, WEATHER_TOOL]), "tools[2].function.name"),
        (dict(messages=[*ASK_WEATHER, {"role": "assistant", "tool_calls": [call]},
                        {"role": "tool", "content": "sunny"}], tools=[WEATHER_TOOL]), "messages[2].tool_call_id"),
        (dict(messages=[*ASK_WEATHER, {"role": "assistant", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]), "messages[1].tool_calls[0].function.arguments"),
        (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
        (dict(tools=[WEATHER_TOOL], parallel_tool_calls="yes"), "parallel_tool_calls"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, **{"messages": ASK_WEATHER, "max_tokens": 4, **fields})
        assert info.value.param == param, (fields, info.value.body)
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert chat(client, max_tokens=2, extra_body=ALWAYS_LENGTH).choices[0].finish_reason == "length"


def test_completions_honour_response_format(server, client):
    """/v1/completions takes `response_format` as vLLM does (it used to be ignored there)."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer"], "additionalProperties": False}
    reply = client.completions.create(model=MODEL, prompt="The answer as JSON:", max_tokens=30, temperature=0,
                                      extra_body={"response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "a", "schema": schema}}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), schema)
    bad = httpx.post(server.base_url + "/v1/completions", timeout=60,
                     json={"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.name"


def test_python_dash_m_kvserve_is_the_cli():
    result = subprocess.run([sys.executable, "-m", "kvserve", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip()


def test_a_schema_feature_the_engine_cannot_enforce_is_a_400_naming_it(server, client):
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    for fields, param in [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": unique}}},
             "response_format.json_schema"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"ids": unique}}}}], "tool_choice": "required"}, "tool_choice")]:
        reply = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "uniqueItems" in error["message"], error
    assert chat(client, max_tokens=2, extra_body=ALWAYS_LENGTH).choices[0].finish_reason == "length"


def test_streamed_tool_calls_with_n_2_are_each_complete(client):
    chunks = list(chat(client, messages=ASK_WEATHER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                       parallel_tool_calls=False, stream=True, n=2, temperature=1.0, seed=3,
                       max_tokens=BOUNDED_OUTPUT_TOKENS))
    arguments, names, finishes = {0: "", 1: ""}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                if call.id:
                    assert choice.index not in names
                    names[choice.index] = call.function.name
                arguments[choice.index] += call.function.arguments or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    for index in (0, 1):
        jsonschema.validate(json.loads(arguments[index]), tools[names[index]])
