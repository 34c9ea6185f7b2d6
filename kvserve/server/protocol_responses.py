"""OpenAI Responses API request shapes (pydantic, strict) and their translation into chat terms.

`input` is a string or a list of items: messages (`input_text` / `output_text` parts),
`function_call`, `function_call_output` and `reasoning` (given back: its text becomes the
reasoning of the assistant turn that follows it). Tools are function tools in the flat shape
(`{"type": "function", "name", "parameters", ...}`); `text.format` is `text`,
`json_object` or `json_schema` (flat: `{"type", "name", "schema", "strict"}`). Fields
kvserve does not implement are accepted only at their "off" value.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictStr

from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import ChatMessage, StrictModel, UnsupportedFeatureError
from kvserve.server.structured import ConstraintSource, format_constraint

# More input items than this is a 400 before anything is rendered (the prompt limit
# would refuse them anyway, after rendering them all).
MAX_INPUT_ITEMS = 4096
_TEXT_PARTS = ("input_text", "output_text", "text")
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# The efforts harmony's system message knows, for each the API knows.
_HARMONY_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                    "xhigh": "high"}
_SUMMARIES = ("auto", "concise", "detailed")


class ReasoningConfig(StrictModel):
    """`reasoning`: `effort` (how long the model thinks; "none" turns a think-block model's
    thinking off) and `summary` (accepted; kvserve writes no summaries: `summary` stays empty)."""

    effort: StrictStr | None = None
    summary: StrictStr | None = None
    generate_summary: StrictStr | None = None

    def check(self) -> None:
        if self.effort is not None and self.effort not in REASONING_EFFORTS:
            raise InvalidRequestError(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}; "
                                      f"got {self.effort!r}", "reasoning.effort")
        for name in ("summary", "generate_summary"):
            value = getattr(self, name)
            if value is not None and value not in _SUMMARIES:
                raise InvalidRequestError(f"reasoning.{name} must be one of {', '.join(_SUMMARIES)}; got {value!r}",
                                          f"reasoning.{name}")

    def harmony_effort(self) -> str | None:
        return _HARMONY_EFFORTS.get(self.effort) if self.effort else None

    def enable_thinking(self) -> bool | None:
        return False if self.effort == "none" else None


class TextFormat(StrictModel):
    """`text.format`: `{"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}`."""

    type: StrictStr = "text"
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: StrictStr | None = None


class TextConfig(StrictModel):
    """`text`: the output format (`verbosity` is accepted and ignored)."""

    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    """Body of POST /v1/responses."""

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    # Extensions (vLLM's names).
    top_k: int | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: int | None = None
    reasoning: ReasoningConfig | None = None

    def check_supported(self) -> None:
        if self.reasoning is not None:
            self.reasoning.check()
        if self.truncation == "auto":
            raise UnsupportedFeatureError("truncation", "truncation 'auto' is not supported by kvserve: "
                                          "input over the context is refused")
        if self.top_logprobs:
            raise UnsupportedFeatureError("top_logprobs", "top_logprobs is not supported on /v1/responses")
        if self.background and not self.store:
            raise UnsupportedFeatureError("background", "background responses must be stored (store: true)")
        if self.background and self.stream:
            raise UnsupportedFeatureError("background", "background responses cannot be streamed by kvserve: "
                                          "poll GET /v1/responses/{id}")
        if isinstance(self.input, list) and len(self.input) > MAX_INPUT_ITEMS:
            raise InvalidRequestError(f"input has {len(self.input)} items; at most {MAX_INPUT_ITEMS} are "
                                      "accepted", "input")

    def chat_tools(self) -> list[dict]:
        """The function tools in the Chat Completions shape."""
        tools = []
        for index, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise UnsupportedFeatureError(f"tools[{index}].type", f"tools[{index}]: tool type "
                                              f"{tool.get('type')!r} is not supported (only 'function')")
            function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
            if function.get("parameters") is None:
                function.pop("parameters", None)
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> str | dict | None:
        """`tool_choice` in the Chat Completions shape."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                                          "{'type': 'function', 'name': ...}", "tool_choice")
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def constraint(self) -> ConstraintSource | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        return format_constraint(fmt.type, {k: v for k, v in spec.items() if v is not None},
                                 "text.format", "text.format")


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`input` as chat messages: consecutive `function_call` items join the assistant turn
    before them, each `function_call_output` is a "tool" message, and the text of `reasoning`
    items is the reasoning of the assistant turn after them (none follows: it is dropped)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    reasoning: list[str] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
            continue
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", content=_output_text(item.get("output"), f"{where}.output"),
                                        tool_call_id=_string(item, "call_id", where)))
        else:
            raise InvalidRequestError(f"{where}: item type {kind!r} is not supported (kvserve takes messages, "
                                      "function_call, function_call_output and reasoning)", f"{where}.type")
        if reasoning and messages[-1].role == "assistant":
            messages[-1].reasoning_content = "\n".join(reasoning)
        reasoning = []
    if not messages:
        raise InvalidRequestError("input must not be empty", "input")
    return messages


def _reasoning_text(item: dict, where: str) -> str:
    """A `reasoning` item's text: its `content` (reasoning_text parts), else its summary."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequestError(f"{where}.content must be a list of {{'type': 'reasoning_text', 'text': ...}} parts",
                                  f"{where}.content")
    return "\n".join(p["text"] for p in parts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _message(item: dict, where: str) -> ChatMessage:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(_MESSAGE_ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return ChatMessage(role=role, content=content)
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS:
            raise UnsupportedFeatureError(f"{where}.content[{j}]", f"{where}.content[{j}]: content part type "
                                          f"{kind!r} is not supported (kvserve serves text-only models)")
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.content[{j}].text must be a string", f"{where}.content[{j}].text")
        texts.append(part["text"])
    return ChatMessage(role=role, content="".join(texts))


def _add_call(messages: list[ChatMessage], item: dict, where: str) -> None:
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"{where}.arguments must be a string (the arguments as JSON text)",
                                  f"{where}.arguments")
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise InvalidRequestError(f"{where} must be a string or a list of input_text parts", where)
