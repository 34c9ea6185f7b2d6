"""The checks OpenAI makes on `tools` and on the tool turns of `messages`.

Each failure is an `InvalidRequestError` (HTTP 400) naming the offending field, as
OpenAI names it: a function name outside `[a-zA-Z0-9_-]{1,64}` or used twice, `parameters`
that are not a valid JSON schema (checked against the schema's own metaschema with the
`jsonschema` package, Draft 2020-12 unless `$schema` says otherwise) or not of type
object; in `messages`, an assistant's `tool_calls` without an id, a type "function", a
function name or string arguments, a "tool" message without `tool_call_id` or answering
no call of the assistant message before it, and a call left without its "tool" answer.
"""
from __future__ import annotations

import re
from typing import Any

from kvserve.errors import InvalidRequestError

_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def check_tools(tools: list[dict]) -> None:
    """Function names (well-formed, distinct) and parameter schemas of already well-shaped `tools`."""
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        if not _FUNCTION_NAME.fullmatch(name):
            raise InvalidRequestError(f"tools[{index}].function.name {name!r} must be 1 to 64 letters, digits, "
                                      "underscores or dashes", f"tools[{index}].function.name")
        if name in seen:
            raise InvalidRequestError(f"tools[{index}].function.name {name!r} is also the name of tools[{seen[name]}]:"
                                      " function names must be unique", f"tools[{index}].function.name")
        seen[name] = index
        if "parameters" in function:
            _check_parameters(function["parameters"], f"tools[{index}].function.parameters")


def _check_parameters(schema: dict, param: str) -> None:
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path)
        raise InvalidRequestError(f"{param} is not a valid JSON schema"
                                  f"{f' (at {where})' if where else ''}: {exc.message}", param) from None
    if schema.get("type", "object") != "object":
        raise InvalidRequestError(f"{param} must be a JSON schema of type 'object', not {schema['type']!r}", param)


def check_tool_messages(messages: list[Any]) -> None:
    """The tool turns of a conversation (`ChatMessage`s): each assistant `tool_calls` entry
    well-formed and answered by "tool" messages right after it, each "tool" message answering
    one of those calls."""
    awaiting: dict[str, int] = {}  # ids of the last assistant message's calls not answered yet
    answerable: set[str] | None = None  # ids the current run of "tool" messages may answer
    for index, message in enumerate(messages):
        if message.role == "tool":
            _check_tool_answer(message, index, answerable)
            awaiting.pop(message.tool_call_id, None)
            continue
        _check_answered(awaiting)
        answerable = None
        if message.tool_calls is not None:
            if message.role != "assistant":
                raise InvalidRequestError(f"messages[{index}]: only assistant messages carry tool_calls",
                                          f"messages[{index}].tool_calls")
            ids = [_checked_call_id(call, f"messages[{index}].tool_calls[{j}]")
                   for j, call in enumerate(message.tool_calls)]
            awaiting, answerable = {call_id: index for call_id in ids}, set(ids)
    _check_answered(awaiting)


def _check_tool_answer(message: Any, index: int, answerable: set[str] | None) -> None:
    if not message.tool_call_id:
        raise InvalidRequestError(f"messages[{index}]: a 'tool' message needs the tool_call_id it answers",
                                  f"messages[{index}].tool_call_id")
    if answerable is None:
        raise InvalidRequestError(f"messages[{index}]: a 'tool' message must answer a preceding assistant "
                                  "message with tool_calls", f"messages[{index}].role")
    if message.tool_call_id not in answerable:
        raise InvalidRequestError(f"messages[{index}].tool_call_id {message.tool_call_id!r} is not the id of a "
                                  "call in the assistant message before it", f"messages[{index}].tool_call_id")


def _check_answered(awaiting: dict[str, int]) -> None:
    if awaiting:
        assistant = next(iter(awaiting.values()))
        raise InvalidRequestError(f"messages[{assistant}]: an assistant message with tool_calls must be followed by "
                                  f"'tool' messages answering each call; unanswered: {', '.join(awaiting)}",
                                  f"messages[{assistant}].tool_calls")


def _checked_call_id(call: dict, where: str) -> str:
    """The id of one assistant tool call (an object: the request model checked that), after checking its shape."""
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise InvalidRequestError(f"{where}.id must be a non-empty string", f"{where}.id")
    if call.get("type") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function'", f"{where}.type")
    function = call.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function must be an object", f"{where}.function")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    if not isinstance(function.get("arguments"), str):
        raise InvalidRequestError(f"{where}.function.arguments must be a string (the arguments as JSON text), "
                                  f"not {type(function.get('arguments')).__name__}", f"{where}.function.arguments")
    return call["id"]
