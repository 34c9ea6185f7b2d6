"""gpt-oss's harmony format: the prompt kvserve renders and the reply read by channel.

Oracle: the examples of the format's specification (openai/harmony, docs/format.md),
written out here: the prompt of a conversation with function tools, the follow-up after a
tool call, the reasoning dropped after a final answer; the replies with reasoning, a call,
a preamble and a recipient in the role part. The streamed reading is checked against the
whole reading, feeding the reply one token at a time (special tokens whole, as a
tokenizer emits them).
"""
from __future__ import annotations

import datetime
import re

import pytest

from kvserve.errors import InvalidRequestError
from kvserve.server.harmony import harmony_forcing_grammar, render_harmony
from kvserve.server.harmony_reply import HarmonyStreamer, parse_reply
from kvserve.server.protocol import ChatMessage

DATE = datetime.date(2025, 6, 28)
SYSTEM_WITH_FUNCTIONS = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>")
DEVELOPER_WITH_FUNCTIONS = """<|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|>"""
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "required": ["location"], "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "format": FORMAT}}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers",
        "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "required": ["locations"], "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
            "format": FORMAT}}}},
]
QUESTION = [ChatMessage(role="system", content="Use a friendly tone."),
            ChatMessage(role="user", content="What is the weather like in SF?")]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location":"San Francisco"}'}}


def test_prompt_with_function_tools_is_the_specifications():
    expected = (SYSTEM_WITH_FUNCTIONS + DEVELOPER_WITH_FUNCTIONS
                + "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant")
    assert render_harmony(QUESTION, TOOLS, "high", today=DATE) == expected


def test_tool_result_follow_up_keeps_the_turns_reasoning():
    """After a call, the call, its reasoning and the tool's output go back to the model."""
    messages = QUESTION + [
        ChatMessage(role="assistant", reasoning_content="Need to use function get_weather.", tool_calls=[CALL]),
        ChatMessage(role="tool", tool_call_id="call_1", content='{"sunny": true, "temperature": 20}')]
    expected = (SYSTEM_WITH_FUNCTIONS + DEVELOPER_WITH_FUNCTIONS
                + "<|start|>user<|message|>What is the weather like in SF?<|end|>"
                "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                '<|message|>{"location":"San Francisco"}<|call|>'
                "<|start|>functions.get_weather to=assistant<|channel|>commentary"
                '<|message|>{"sunny": true, "temperature": 20}<|end|><|start|>assistant')
    assert render_harmony(messages, TOOLS, "high", today=DATE) == expected


def test_reasoning_of_a_finished_answer_is_dropped():
    """A later user turn drops the earlier turn's reasoning; history ends messages with <|end|>."""
    messages = [ChatMessage(role="user", content="What is 2 + 2?"),
                ChatMessage(role="assistant", content="2 + 2 = 4.",
                            reasoning_content='User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'),
                ChatMessage(role="user", content="What about 9 / 2?")]
    system = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
              "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: medium\n\n"
              "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>")
    assert render_harmony(messages, None, None, today=DATE) == (
        system + "<|start|>user<|message|>What is 2 + 2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant")


def test_schema_types_render_as_typescript():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "default": 3}, "flag": {"type": ["boolean", "null"]},
        "pair": {"anyOf": [{"type": "string"}, {"type": "number"}]},
        "inner": {"type": "object", "properties": {"x": {"const": "a"}}, "required": ["x"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}}}
    text = render_harmony([ChatMessage(role="user", content="hi")], [tool], "low", today=DATE)
    assert ("type f = (_: {\nn?: number, // default: 3\nflag?: boolean | null,\npair?: string | number,\n"
            'inner?: {\nx: "a",\n},\ntags?: ("a" | "b")[],\n}) => any;\n\n} // namespace functions') in text


def test_bad_reasoning_effort_and_unanswerable_tool_message_are_refused():
    with pytest.raises(InvalidRequestError) as error:
        render_harmony(QUESTION, None, "extreme")
    assert error.value.param == "reasoning_effort"
    with pytest.raises(InvalidRequestError):
        render_harmony(QUESTION + [ChatMessage(role="tool", tool_call_id="nope", content="1")], None, None)


REPLIES = [
    # (reply, reasoning, content, [(name, arguments)])
    ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
     "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
     'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
    ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>',
     "Need to use function get_weather.", "", [("get_weather", '{"location":"San Francisco"}')]),
    ("<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary<|message|>**Action plan**:"
     "\n1. Generate an HTML file<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file"
     '<|constrain|>json<|message|>{"template": "basic_html", "path": "index.html"}<|call|>',
     "plan", "**Action plan**:\n1. Generate an HTML file",
     [("generate_file", '{"template": "basic_html", "path": "index.html"}')]),
    # The recipient in the role part of the header, first message included.
    (' to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}<|call|>', "", "",
     [("lookup", '{"q": 1}')]),
    # A built-in tool's call is reasoning (kvserve runs no built-in tools).
    ('<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|end|>'
     "<|start|>assistant<|channel|>final<|message|>done<|return|>", '{"query": "x"}', "done", []),
    # A model not writing harmony: its text is content.
    ("plain words", "", "plain words", []),
    # Cut off by max_tokens inside the analysis, and inside a header.
    ("<|channel|>analysis<|message|>half a tho", "half a tho", "", []),
    ("<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>fin", "done", "", []),
]


def _tokens(text: str) -> list[str]:
    """`text` as a tokenizer streams it: special tokens whole, other text a character at a time."""
    pieces = [piece for piece in re.split(r"(<\|[a-z]+\|>)", text) if piece]
    return [token for piece in pieces for token in ([piece] if piece.startswith("<|") else list(piece))]


@pytest.mark.parametrize("reply,reasoning,content,calls", REPLIES)
def test_reply_by_channel_whole_and_streamed(reply, reasoning, content, calls):
    got_reasoning, got_content, got_calls = parse_reply(reply, parses_calls=True)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(call.name, call.arguments) for call in got_calls] == calls
    streamer, text, deltas = HarmonyStreamer(parses_calls=True), "", []
    for token in _tokens(reply):
        text += token
        deltas += streamer.update(text)
    deltas += streamer.finish(text)
    streamed = {"reasoning_content": "", "content": ""}
    streamed_calls: list[list[str]] = []
    for delta in deltas:
        for key in ("reasoning_content", "content"):
            streamed[key] += delta.get(key, "")
            assert "<|" not in delta.get(key, "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                streamed_calls.append([call["function"]["name"], ""])
            streamed_calls[call["index"]][1] += call["function"]["arguments"]
    assert streamed == {"reasoning_content": reasoning, "content": content}
    assert [tuple(call) for call in streamed_calls] == calls


def test_calls_are_content_when_the_request_may_not_call():
    reply = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    assert parse_reply(reply, parses_calls=False)[1:] == ('{"a": 1}', [])


def test_forcing_grammar_admits_exactly_the_calls():
    import llguidance
    from helpers.harmony_model import harmony_tokenizer
    import llguidance.hf

    tokenizer = harmony_tokenizer()
    grammar = harmony_forcing_grammar([TOOLS[1]["function"]])
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    good = '<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>{"location": "SF"}'
    assert accepts(good + "<|call|>")
    assert not accepts(good)  # a call ends with <|call|>
    assert not accepts(good.replace('"SF"', "3") + "<|call|>")
    assert not accepts(good.replace("get_current_weather", "get_location") + "<|call|>")
