"""OpenAI tool calling: validation, prompt rendering, output parsing and forcing grammars.

Formats (`--tool-call-parser`, else picked from the chat template):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per call (Qwen2.5,
  SmolLM, Hermes); also the built-in fallback template's format;
- `llama3_json`: a bare `{"name": ..., "parameters": {...}}` object, calls separated by `;`,
  optionally after `<|python_tag|>`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`;
- `harmony`: gpt-oss's channels (kvserve/server/harmony.py renders the prompt,
  kvserve/server/harmony_reply.py reads the reply); picked when the tokenizer has the
  harmony tokens, and then the reply is always read by channel, tools or not.

`tool_choice` `required` or a named function becomes a grammar (llguidance Lark with
embedded JSON schemas) so that any model answers with calls whose arguments fit the
schemas; `auto` leaves the model free and parses what it wrote; `none` renders no tools.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.server.harmony import harmony_forcing_grammar
from kvserve.server.tool_checks import check_tools

PARSERS = ("hermes", "llama3_json", "mistral", "harmony")
# Compact JSON inside tool-call grammars, as for other JSON constraints.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Used when the model's own template has no tool support: ChatML with Hermes-style calls.
FALLBACK_TOOL_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}{%- endif -%}
<|im_start|>system
{{ ns.system or 'You are a helpful assistant.' }}
{%- if tools %}

You may call functions. Their signatures, as JSON schemas, are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call a function, answer with one JSON object per call inside <tool_call></tool_call> tags:
<tool_call>
{"name": "<function name>", "arguments": {<arguments as JSON>}}
</tool_call>
{%- endif %}<|im_end|>
{% for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls -%}
<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls %}<tool_call>
{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


@dataclass
class ToolRequest:
    """The tools of one chat request, checked: what to render, whether to force calls, how to parse."""

    tools: list[dict]
    choice: str  # "none", "auto", "required", or "named"
    named_function: str | None
    parallel: bool
    parser: str
    # A model that writes its reasoning in a <think> block (kvserve/server/think_reply.py): the
    # reply is read for one; `thinking_open`: the prompt opened it already.
    reads_thinking: bool = False
    thinking_open: bool = False

    @property
    def rendered_tools(self) -> list[dict] | None:
        return None if self.choice == "none" or not self.tools else self.tools

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def parses_reply(self) -> bool:
        """Whether the reply is read rather than passed on as text (calls, harmony's channels, a think block)."""
        return self.parses_calls or self.parser == "harmony" or self.reads_thinking

    def forcing_grammar(self) -> str | None:
        """A Lark grammar that admits only well-formed calls, for `required` and a named function."""
        if self.choice not in ("required", "named"):
            return None
        functions = [t["function"] for t in self.tools
                     if self.choice == "required" or t["function"]["name"] == self.named_function]
        if self.parser == "harmony":
            return harmony_forcing_grammar(functions)
        args_key = "parameters" if self.parser == "llama3_json" else "arguments"
        call_schemas = [{"type": "object", "properties": {
            "name": {"const": f["name"]}, args_key: f.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False} for f in functions]
        call = {"anyOf": call_schemas} if len(call_schemas) > 1 else call_schemas[0]
        call["x-guidance"] = _JSON_OPTIONS
        repeat = self.parallel and self.choice == "required"
        if self.parser == "hermes":
            rules = ['call: "<tool_call>\\n" body "\\n</tool_call>"', f"body: %json {json.dumps(call)}"]
            start = 'start: call ("\\n" call)*' if repeat else "start: call"
        elif self.parser == "llama3_json":
            rules = [f"call: %json {json.dumps(call)}"]
            start = 'start: call ("; " call)*' if repeat else "start: call"
        else:
            calls = {"type": "array", "items": call, "minItems": 1, "x-guidance": _JSON_OPTIONS}
            if not repeat:
                calls["maxItems"] = 1
            rules = [f"calls: %json {json.dumps(calls)}"]
            start = "start: calls"
        return "\n".join([start, *rules])


def parse_tool_request(body: Any, default_parser: str) -> ToolRequest | None:
    """The request's tools and tool_choice, validated (400 naming the field), or None without tools."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                                      f"tools[{index}]")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object",
                                      f"tools[{index}].function.parameters")
    check_tools(tools)
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not isinstance(named, str):
            raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if named not in {t["function"]["name"] for t in tools}:
            raise InvalidRequestError(f"tool_choice names {named!r}, which is not in tools", "tool_choice")
        choice = "named"
    elif choice is None:
        choice = "auto"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequestError(f"tool_choice {choice!r} is not 'none', 'auto' or 'required'", "tool_choice")
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolRequest([dict(t, type="function") for t in tools], choice, named, parallel, default_parser)


def parser_for_template(chat_template: str | None) -> str:
    """The call format a chat template teaches its model (hermes when it says nothing)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def template_messages(messages: list[Any]) -> list[dict]:
    """Chat messages as template dicts; assistant tool-call arguments become objects."""
    rendered = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.role == "tool" and getattr(message, "tool_call_id", None):
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        if getattr(message, "reasoning_content", None):
            entry["reasoning_content"] = message.reasoning_content  # Qwen3's templates keep the last turns'
        rendered.append(entry)
    return rendered


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {"id": call.get("id"), "type": "function", "function": function}


def extract_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content before the calls, calls) from a finished output; no calls when none parse."""
    if parser == "hermes":
        # Complete blocks only: a call cut off by max_tokens is not returned.
        matches = list(re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S))
        calls = [_call_from_json(m.group(1), "arguments") for m in matches]
        content = text[:matches[0].start()].strip() if matches else text
    elif parser == "llama3_json":
        body = text.replace("<|python_tag|>", "").strip()
        calls = [_call_from_json(part, "parameters") for part in _split_json_objects(body)] if body[:1] == "{" else []
        content = ""
    else:
        head, marker, tail = text.partition("[TOOL_CALLS]")
        payload = tail if marker else text.strip()
        calls = []
        if payload.strip()[:1] == "[":
            try:
                calls = [_call_from_obj(obj, "arguments") for obj in json.loads(payload)]
            except (json.JSONDecodeError, TypeError):
                calls = []
        content = head.strip() if marker else ""
    if not calls or any(call is None for call in calls):
        return text, []
    return content, calls


def _split_json_objects(text: str) -> list[str]:
    decoder, parts, index = json.JSONDecoder(), [], 0
    while index < len(text):
        try:
            _, end = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[index:end])
        index = end
        while index < len(text) and text[index] in " ;\n":
            index += 1
    return parts


def _call_from_json(text: str, args_key: str) -> ToolCall | None:
    try:
        return _call_from_obj(json.loads(text), args_key)
    except json.JSONDecodeError:
        return None


def _call_from_obj(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
