"""gpt-oss's harmony chat format: the prompt kvserve renders for it and the tool-forcing grammar.

A harmony prompt is a run of messages `<|start|>{header}<|message|>{content}<|end|>`
(docs/format.md of openai/harmony): a system message (identity, dates, reasoning effort,
channels), a developer message (the request's system/developer instructions and its
function tools as a TypeScript-like `namespace functions`), then the conversation.
Assistant turns of history go to the `final` channel; their `reasoning_content` is kept
only after the last user message (chain of thought between tool calls of the turn under
way), as the format asks. The reply is read by `kvserve/server/harmony_reply.py`.

kvserve renders harmony itself rather than through the model's Jinja template, so that a
gpt-oss from GGUF and one from a Hugging Face directory get the same prompt and the
parser reads exactly what the prompt taught.
"""
from __future__ import annotations

import datetime
import json
from typing import Any

from kvserve.errors import InvalidRequestError

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# The tokens at which a harmony reply stops (the format's two stop tokens).
STOP_TOKENS = (RETURN, CALL)
REASONING_EFFORTS = ("low", "medium", "high")
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"


def harmony_token_ids(tokenizer: Any) -> dict[str, int] | None:
    """{special token: id} when the tokenizer has every harmony token as one token, else None."""
    added = getattr(tokenizer, "get_added_vocab", None)
    vocab = added() if callable(added) else {}
    if not all(token in vocab for token in SPECIAL_TOKENS):
        return None
    return {token: vocab[token] for token in SPECIAL_TOKENS}


def render_harmony(messages: list[Any], tools: list[dict] | None, reasoning_effort: str | None,
                   add_generation_prompt: bool = True, today: datetime.date | None = None) -> str:
    """The prompt text of a conversation (protocol `ChatMessage`s) with its function tools."""
    effort = reasoning_effort or "medium"
    if effort not in REASONING_EFFORTS:
        raise InvalidRequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                  "reasoning_effort")
    parts = [_system_message(effort, bool(tools), today or datetime.date.today())]
    instructions = "\n\n".join(m.text() for m in messages if m.role in ("system", "developer"))
    developer = _developer_content(instructions, tools or [])
    if developer:
        parts.append(f"{START}developer{MESSAGE}{developer}{END}")
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    call_names: dict[str, str] = {}
    for index, message in enumerate(messages):
        if message.role == "user":
            parts.append(f"{START}user{MESSAGE}{message.text()}{END}")
        elif message.role == "assistant":
            parts.extend(_assistant_messages(message, index > last_user, call_names))
        elif message.role == "tool":
            name = call_names.get(message.tool_call_id or "") or message.name
            if not name:
                raise InvalidRequestError(f"messages[{index}]: a 'tool' message must answer a call", "messages")
            parts.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{message.text()}{END}")
    if add_generation_prompt:
        parts.append(f"{START}assistant")
    return "".join(parts)


def _system_message(effort: str, has_functions: bool, today: datetime.date) -> str:
    text = (f"{IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {today.isoformat()}\n\n"
            f"Reasoning: {effort}\n\n"
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
    if has_functions:
        text += "\nCalls to these tools must go to the commentary channel: 'functions'."
    return f"{START}system{MESSAGE}{text}{END}"


def _developer_content(instructions: str, tools: list[dict]) -> str:
    sections = [f"# Instructions\n\n{instructions}"] if instructions else []
    if tools:
        sections.append("# Tools\n\n## functions\n\nnamespace functions {\n\n"
                        + "".join(_function_type(tool["function"]) for tool in tools)
                        + "} // namespace functions")
    return "\n\n".join(sections)


def _assistant_messages(message: Any, in_current_turn: bool, call_names: dict[str, str]) -> list[str]:
    parts = []
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning and in_current_turn:
        parts.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{reasoning}{END}")
    content = message.text()
    if content:
        # Text beside tool calls is a preamble, which the format puts on the commentary channel.
        channel = "commentary" if message.tool_calls else "final"
        parts.append(f"{START}assistant{CHANNEL}{channel}{MESSAGE}{content}{END}")
    for call in message.tool_calls or []:
        function = call["function"]
        call_names[call["id"]] = function["name"]
        parts.append(f"{START}assistant{CHANNEL}commentary to=functions.{function['name']} "
                     f"{CONSTRAIN}json{MESSAGE}{function['arguments']}{CALL}")
    return parts


def _function_type(function: dict) -> str:
    """`// description` and `type name = (_: {...}) => any;` for one function tool."""
    comment = "".join(f"// {line}\n" for line in (function.get("description") or "").splitlines())
    parameters = function.get("parameters") or {}
    if not parameters.get("properties"):
        return f"{comment}type {function['name']} = () => any;\n\n"
    return f"{comment}type {function['name']} = (_: {_object_type(parameters)}) => any;\n\n"


def _object_type(schema: dict) -> str:
    required = set(schema.get("required") or [])
    lines = ["{"]
    for name, field_schema in (schema.get("properties") or {}).items():
        field_schema = field_schema if isinstance(field_schema, dict) else {}
        for line in (field_schema.get("description") or "").splitlines():
            lines.append(f"// {line}")
        optional = "" if name in required else "?"
        default = f" // default: {_default_text(field_schema['default'])}" if "default" in field_schema else ""
        lines.append(f"{name}{optional}: {_type_text(field_schema)},{default}")
    lines.append("}")
    return "\n".join(lines)


def _default_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _type_text(schema: dict) -> str:
    """A JSON schema as a TypeScript type: literals for enums and consts, unions for anyOf/oneOf."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    if "const" in schema:
        return json.dumps(schema["const"])
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(_type_text(option) for option in schema[key] if isinstance(option, dict))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type_text({**schema, "type": one}) for one in kind)
    if kind == "array":
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        item = _type_text(items)
        return f"({item})[]" if " | " in item else f"{item}[]"
    if kind == "object":
        return _object_type(schema) if schema.get("properties") else "object"
    return {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
            "null": "null"}.get(kind, "any")


def harmony_forcing_grammar(functions: list[dict]) -> str:
    """A Lark grammar (llguidance, special tokens as `<|...|>`) admitting only one call to one of
    `functions` on the commentary channel, its arguments fitting the function's schema. A
    harmony call ends the turn (`<|call|>` is a stop token), so there is one call per reply."""
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    rules, names = [], []
    for index, function in enumerate(functions):
        schema = dict(function.get("parameters") or {"type": "object"}, **{"x-guidance": options})
        names.append(f"call{index}")
        rules.append(f'call{index}: {CHANNEL} "commentary to=functions.{function["name"]} " {CONSTRAIN} "json" '
                     f"{MESSAGE} args{index} {CALL}")
        rules.append(f"args{index}: %json {json.dumps(schema)}")
    return "\n".join([f"start: {' | '.join(names)}", *rules])
