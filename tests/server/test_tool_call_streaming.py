"""Streamed tool calls arrive while they are generated: id and name first, then argument
fragments, for the Hermes, Llama-3 JSON and Mistral formats.

Two oracles: a hand-written check of the chunk sequence, fed token by token with the
default tokenizer's own decoding; and, against the real engine behind one server per
parser, the official openai client's stream accumulation compared with the same
request answered without streaming.
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from kvserve.server.tool_stream import ToolCallStreamer, json_value_end, read_call_header
from kvserve.engine.create_config import create_engine_config
from server.conftest import ThreadedServer

MODEL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
ARGS = ['{"city": "Paris \\"17\\"", "days": 3}', '{"zone": "CET"}']
OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS[0] + '}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": ' + ARGS[1] + '}\n</tool_call>', "Let me check."),
    "llama3_json": ('{"name": "get_weather", "parameters": ' + ARGS[0] + '}; {"name": "get_time", "parameters": '
                    + ARGS[1] + '}', ""),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS[0] + '}, {"name": "get_time", '
                '"arguments": ' + ARGS[1] + '}]', ""),
}


def _stream_text_by_token(tokenizer, parser: str, text: str) -> list[dict]:
    """The streamer's deltas when `text` grows one token at a time (as the detokenizer gives it)."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    streamer = ToolCallStreamer(parser, parallel=True)
    deltas = []
    for end in range(1, len(token_ids)):
        deltas.extend(streamer.update(tokenizer.decode(token_ids[:end])))
    deltas.extend(streamer.finish(tokenizer.decode(token_ids)))
    return deltas


def check_call_sequence(deltas: list[dict], names: list[str], arguments: list[str], content: str) -> None:
    """Content (if any) first; per call a header (index, id, type, name, empty arguments)
    before any of its fragments; each call's arguments in several fragments."""
    seen_content = "".join(d.get("content") or "" for d in deltas)
    assert seen_content == content
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert not any(d.get("content") for d in deltas[first_call:]), "content after a call started"
    for index, (name, expected) in enumerate(zip(names, arguments)):
        mine = [c for c in calls if c["index"] == index]
        header, fragments = mine[0], mine[1:]
        assert header["id"].startswith("call_") and header["type"] == "function"
        assert header["function"] == {"name": name, "arguments": ""}
        assert all("id" not in c and "name" not in c["function"] for c in fragments)
        assert "".join(c["function"]["arguments"] for c in fragments) == expected
        assert len(fragments) >= 4, f"call {index} arrived in {len(fragments)} fragment(s)"
    assert len({c["index"] for c in calls}) == len(names)


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_calls_stream_token_by_token(tokenizer, parser):
    text, content = OUTPUTS[parser]
    deltas = _stream_text_by_token(tokenizer, parser, text)
    check_call_sequence(deltas, ["get_weather", "get_time"], ARGS, content)
    # The second call's header comes before the end of the text, not with the finish.
    tool_deltas = [d for d in deltas if d.get("tool_calls")]
    assert tool_deltas[-1]["tool_calls"][0]["index"] == 1 and "id" not in tool_deltas[-1]["tool_calls"][0]


def test_text_that_only_looks_like_a_call_start_is_content(tokenizer):
    text = "Use <tool> or <tool_c as tags, and {braces}."
    for parser in ("hermes", "mistral"):
        deltas = _stream_text_by_token(tokenizer, parser, text)
        assert "".join(d["content"] for d in deltas) == text and len(deltas) > 3
    # A Llama-3 answer starting with "{" could be a call: held back, then sent as content.
    deltas = _stream_text_by_token(tokenizer, "llama3_json", '{"answer": 42}')
    assert deltas == [{"content": '{"answer": 42}'}]


def test_calls_of_another_key_order_are_sent_whole_at_the_end(tokenizer):
    text = '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>'
    deltas = _stream_text_by_token(tokenizer, "hermes", text)
    assert [c["function"] for d in deltas for c in d["tool_calls"]] == [
        {"name": "get_time", "arguments": ""}, {"arguments": '{"zone": "CET"}'}]


def test_a_cut_off_call_sends_what_was_written_and_nothing_more(tokenizer):
    streamer = ToolCallStreamer("hermes", parallel=False)
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CE'
    deltas = streamer.update(text) + streamer.finish(text)
    assert [c["function"] for d in deltas for c in d["tool_calls"]] == [
        {"name": "get_time", "arguments": ""}, {"arguments": '{"zone": "CE'}]


def test_json_scanning_helpers():
    text = '{"a": "x}\\"", "b": [1, {"c": null}]} tail'
    assert json_value_end(text, 0) == text.index(" tail")
    assert json_value_end(text[:-6], 0) is None
    assert json_value_end("12, ", 0) == 2 and json_value_end("12", 0) is None
    assert read_call_header('{"name": "f", "arguments": {', 0, ("arguments",)) == ("f", 27)
    assert read_call_header('{"na', 0, ("arguments",)) is None
    assert read_call_header('{"id": 1', 0, ("arguments",)) is False
    assert read_call_header('{"name": "f", "x": 1', 0, ("arguments",)) is False


# ---- the real engine behind one server per parser ---------------------------------

@pytest.fixture(scope="module")
def engine():
    from kvserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM(create_engine_config(max_model_len=1024, kv_cache_memory="48MiB"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_real_server_streams_forced_calls_incrementally(engine, parser):
    from kvserve.server.app import build_app

    ask = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    request = dict(model=MODEL, messages=ask, tools=[WEATHER, TIME], temperature=0, max_tokens=80,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with ThreadedServer(build_app(engine, MODEL, shutdown_engine=False, tool_call_parser=parser)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        whole = client.chat.completions.create(**request)
        chunks = list(client.chat.completions.create(**request, stream=True))
        with client.chat.completions.stream(**request) as stream:
            accumulated = stream.get_final_completion()
    expected = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and len(expected) == 1
    arguments = json.loads(expected[0].function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    # The openai client's accumulation of the stream gives the non-streamed call.
    (call,) = accumulated.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", arguments)
    assert accumulated.choices[0].finish_reason == "tool_calls"
    # By hand: one header, then argument fragments, one per chunk, then the finish chunk.
    deltas = [chunk.choices[0].delta.model_dump(exclude_none=True) for chunk in chunks if chunk.choices]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    check_call_sequence([d for d in deltas if d.get("tool_calls")], ["get_weather"],
                        [expected[0].function.arguments], "")
