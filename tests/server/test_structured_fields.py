"""Request fields → constraints, tool parsing and forcing grammars, without a server or model."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve.engine.validation import RequestValidator
from kvserve.errors import InvalidRequestError
from kvserve.sample.structured import grammar
from kvserve.sampling_params import StructuredOutputsParams as Constraint
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.structured import ConstraintSource, compile_constraint, constraint_from_request
from kvserve.server.tool_checks import check_tool_messages
from kvserve.server.tools import extract_tool_calls, parse_tool_request, parser_for_template

TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


@pytest.mark.parametrize("fields, expected, field_name", [
    ({"response_format": {"type": "json_object"}}, Constraint(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}},
     Constraint(json={"type": "integer"}), "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a+"}}, Constraint(regex="a+"), "structured_outputs"),
    ({"guided_choice": ["x", "y"]}, Constraint(choice=["x", "y"]), "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, Constraint(grammar='root ::= "a"'), "guided_grammar"),
    ({"guided_json": {"type": "object"}}, Constraint(json={"type": "object"}), "guided_json"),
])
def test_each_field_maps_to_one_constraint(fields, expected, field_name):
    source = constraint_from_request(request(**fields))
    assert source.params == expected and source.field_name == field_name


@pytest.mark.parametrize("spec, param", [
    (None, "response_format.json_schema"),
    ({"schema": {"type": "object"}}, "response_format.json_schema.name"),
    ({"name": "", "schema": {"type": "object"}}, "response_format.json_schema.name"),
    ({"name": "n", "schema": 5}, "response_format.json_schema.schema"),
    ({"name": "n", "schema": {"type": "object"}, "strict": "yes"}, "response_format.json_schema.strict"),
])
def test_malformed_json_schema_formats_name_their_field(spec, param):
    with pytest.raises(InvalidRequestError) as info:
        constraint_from_request(request(response_format={"type": "json_schema", "json_schema": spec}))
    assert info.value.param == param


def test_a_json_schema_format_without_a_schema_is_any_object():
    source = constraint_from_request(request(response_format={"type": "json_schema", "json_schema": {"name": "n"}}))
    assert source.params == Constraint(json={"type": "object"})


def test_completions_take_response_format_too():
    body = CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert constraint_from_request(body).params == Constraint(json_object=True)


def test_text_and_nothing_mean_no_constraint():
    assert constraint_from_request(request(response_format={"type": "text"})) is None
    assert constraint_from_request(request()) is None


def test_two_constraints_are_refused():
    with pytest.raises(InvalidRequestError) as info:
        constraint_from_request(request(response_format={"type": "json_object"}, guided_regex="a"))
    assert info.value.param == "guided_regex"


def test_compile_timeout_is_a_400_naming_the_field(monkeypatch):
    class SlowCompiler:
        pool = ThreadPoolExecutor(1)

        def compile_async(self, params):
            return self.pool.submit(time.sleep, 1.0)

    monkeypatch.setattr(grammar, "compiler_for_model", lambda model_config, load_tokenizer: SlowCompiler())
    monkeypatch.setenv(grammar.COMPILE_TIMEOUT_ENV, "0.05")
    source = ConstraintSource(Constraint(regex="a"), "guided_regex")
    validator = RequestValidator(max_model_len=64, vocab_size=10, model_config=object())
    with pytest.raises(InvalidRequestError, match="did not compile within") as info:
        asyncio.run(compile_constraint(validator, source))
    assert info.value.param == "guided_regex"


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", 'Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
               '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', "Sure."),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}',
     ""),
    ("mistral", 'ok [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]',
     "ok"),
])
def test_parsers_extract_calls_with_ids(parser, text, content):
    parsed_content, calls = extract_tool_calls(parser, text)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}), ("add", {"a": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_plain_text_and_a_cut_off_call_are_not_calls():
    assert extract_tool_calls("hermes", "Hello there") == ("Hello there", [])
    assert extract_tool_calls("hermes", '<tool_call>{"name": "add", "argu')[1] == []
    assert extract_tool_calls("llama3_json", "Paris is sunny.")[1] == []


def test_parser_is_picked_from_the_template():
    assert parser_for_template("... [TOOL_CALLS] ...") == "mistral"
    assert parser_for_template("... <|python_tag|> ...") == "llama3_json"
    assert parser_for_template(None) == "hermes"


def _tool(name: str, parameters) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.mark.parametrize("fields, param", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),  # no tools at all
    # under "auto" nothing compiles the schema: it is checked against its metaschema
    ({"tools": [TOOL, _tool("f", {"type": "object", "properties": {"x": {"type": "number", "minimum": "0"}}})],
      "tool_choice": "auto"}, "tools[1].function.parameters"),
    ({"tools": [_tool("f", {"type": "objekt"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool("f", {"type": "object", "required": "x"})], "tool_choice": "none"},
     "tools[0].function.parameters"),
    ({"tools": [_tool("f", {"type": "string"})]}, "tools[0].function.parameters"),
    ({"tools": [TOOL, _tool("g", {}), dict(TOOL)]}, "tools[2].function.name"),  # "add" twice
    ({"tools": [_tool("get weather", {})]}, "tools[0].function.name"),
    ({"tools": [_tool("f" * 65, {})]}, "tools[0].function.name"),
])
def test_bad_tool_fields(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_tool_request(request(**fields), "hermes")
    assert info.value.param == param


def test_good_tools_pass_the_checks():
    tools = [TOOL, _tool("get-time_2", {"type": "object", "properties": {}}), _tool("noop", {}),
             {"type": "function", "function": {"name": "bare"}},
             _tool("draft7", {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                              "properties": {"a": {"type": "integer", "exclusiveMinimum": 0}}})]
    assert parse_tool_request(request(tools=tools, tool_choice="auto"), "hermes").tools[1]["function"]["name"] \
        == "get-time_2"


def _call(call_id="call_1", name="add", arguments='{"a": 1}', **extra) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}, **extra}


ASK = {"role": "user", "content": "add one"}


def _turn(*calls, answers=("call_1",)) -> list[dict]:
    return [ASK, {"role": "assistant", "content": None, "tool_calls": list(calls)},
            *({"role": "tool", "tool_call_id": call_id, "content": "2"} for call_id in answers)]


@pytest.mark.parametrize("messages, param", [
    ([ASK, {"role": "tool", "content": "2"}], "messages[1].tool_call_id"),
    (_turn(_call(), answers=()) + [{"role": "tool", "content": "2"}], "messages[2].tool_call_id"),
    ([ASK, {"role": "tool", "tool_call_id": "call_1", "content": "2"}], "messages[1].role"),
    (_turn(_call(), answers=("call_9",)), "messages[2].tool_call_id"),
    (_turn(_call(arguments={"a": 1})), "messages[1].tool_calls[0].function.arguments"),
    (_turn(_call(arguments=None)), "messages[1].tool_calls[0].function.arguments"),
    (_turn(_call(call_id=None)), "messages[1].tool_calls[0].id"),
    (_turn({"id": "call_1", "function": {"name": "add", "arguments": "{}"}}), "messages[1].tool_calls[0].type"),
    (_turn({"id": "call_1", "type": "function"}), "messages[1].tool_calls[0].function"),
    (_turn(_call(name=7)), "messages[1].tool_calls[0].function.name"),
    (_turn(_call(), _call("call_2")), "messages[1].tool_calls"),  # call_2 never answered
    (_turn(_call(), answers=()) + [{"role": "user", "content": "and?"}], "messages[1].tool_calls"),
    ([{"role": "user", "content": "x", "tool_calls": [_call()]}], "messages[0].tool_calls"),
])
def test_bad_tool_turns_name_the_field(messages, param):
    with pytest.raises(InvalidRequestError) as info:
        check_tool_messages(request(messages=messages).messages)
    assert info.value.param == param, info.value


def test_good_tool_turns_pass():
    parallel = _turn(_call(), _call("call_2", arguments=""), answers=("call_2", "call_1"))
    check_tool_messages(request(messages=parallel + [{"role": "assistant", "content": "3"}, ASK]).messages)
    check_tool_messages(request(messages=[ASK, {"role": "assistant", "content": "hi", "tool_calls": []}]).messages)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forcing_grammars_compile(parser, tool_choice):
    tool_request = parse_tool_request(request(tools=[TOOL], tool_choice=tool_choice), parser)
    import llguidance

    source = llguidance.grammar_from("grammar", tool_request.forcing_grammar())
    assert llguidance.LLMatcher.validate_grammar(source) == ""
    assert parse_tool_request(request(tools=[TOOL], tool_choice="auto"), parser).forcing_grammar() is None
