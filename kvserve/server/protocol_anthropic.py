"""Anthropic Messages API request shapes (pydantic, strict) and their translation into chat terms.

Content blocks: `text`, `tool_use` (assistant turns), `tool_result` (user turns, its
content a string or text blocks); `thinking` blocks given back in assistant turns are the
turn's reasoning (their `signature` checked: kvserve signs the thinking it returns with a key
of its process), `redacted_thinking` ones are dropped. A last assistant turn is a prefill: the
answer continues it. `output_config.format` (a JSON schema) constrains the answer as
`response_format` does in Chat Completions. `thinking` (`enabled` with `budget_tokens` >= 1024
and < `max_tokens`, `adaptive`, or `disabled`, the default) says whether the answer shows the
model's reasoning; `metadata` and `cache_control` are accepted and ignored.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from typing import Any, Literal

from pydantic import Field, StrictStr

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.protocol import ChatMessage, StrictModel, UnsupportedFeatureError
from kvserve.server.structured import ConstraintSource

# More messages than this is a 400 before anything is rendered.
MAX_MESSAGES = 4096
_SKIPPED_BLOCKS = ("redacted_thinking",)
THINKING_TYPES = ("enabled", "adaptive", "disabled")
THINKING_DISPLAYS = ("summarized", "omitted")
MIN_THINKING_BUDGET = 1024
# Signs the thinking this process returns, so that a thinking block given back is known as ours.
_SIGNING_KEY = secrets.token_bytes(32)


def thinking_signature(thinking: str) -> str:
    """The `signature` of a thinking block: an HMAC-SHA256 of its text under this process's key."""
    return base64.b64encode(hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()).decode()


class AnthropicTool(StrictModel):
    """A client tool: `{"name", "description", "input_schema"}` (type "custom" or absent)."""

    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: StrictStr | None = None


class AnthropicMessage(StrictModel):
    """One turn: `role` user or assistant, `content` a string or content blocks."""

    role: Literal["user", "assistant"]
    content: StrictStr | list[dict[str, Any]]


class CountTokensRequest(StrictModel):
    """Body of POST /v1/messages/count_tokens (and the prompt half of /v1/messages)."""

    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if len(self.messages) > MAX_MESSAGES:
            raise InvalidRequestError(f"messages has {len(self.messages)} entries; at most {MAX_MESSAGES} are "
                                      "accepted", "messages")
        self._check_thinking()

    def _check_thinking(self) -> None:
        """`thinking` as Anthropic checks it (400 naming the field)."""
        if self.thinking is None:
            return
        kind = self.thinking.get("type")
        if kind not in THINKING_TYPES:
            raise InvalidRequestError(f"thinking.type must be one of {', '.join(THINKING_TYPES)}; got {kind!r}",
                                      "thinking.type")
        if self.thinking.get("display") not in (None, *THINKING_DISPLAYS):
            raise InvalidRequestError(f"thinking.display must be one of {', '.join(THINKING_DISPLAYS)}",
                                      "thinking.display")
        if kind == "enabled":
            budget = self.thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
                raise InvalidRequestError(f"thinking.budget_tokens must be an integer >= {MIN_THINKING_BUDGET}",
                                          "thinking.budget_tokens")
            max_tokens = getattr(self, "max_tokens", None)
            if max_tokens is not None and max_tokens <= budget:
                raise InvalidRequestError("`max_tokens` must be greater than `thinking.budget_tokens`",
                                          "max_tokens")
        if self.shows_thinking and (self.tool_choice or {}).get("type") in ("any", "tool"):
            raise InvalidRequestError("Thinking may not be enabled when tool_choice forces tool use.",
                                      "tool_choice")

    @property
    def shows_thinking(self) -> bool:
        """Whether the answer shows the model's reasoning (`thinking` enabled or adaptive)."""
        return (self.thinking or {}).get("type") in ("enabled", "adaptive")

    @property
    def omits_thinking_text(self) -> bool:
        """`thinking.display` "omitted": thinking blocks carry a signature but no text."""
        return (self.thinking or {}).get("display") == "omitted"

    def chat_tools(self) -> list[dict]:
        """The tools in the Chat Completions shape."""
        tools = []
        for index, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise UnsupportedFeatureError(f"tools.{index}.type", f"tools.{index}: tool type {tool.type!r} is "
                                              "not supported (only client tools with an input_schema)")
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> tuple[str | dict | None, bool | None]:
        """(tool_choice in the Chat Completions shape, parallel_tool_calls)."""
        choice = self.tool_choice
        if choice is None:
            return None, None
        kind = choice.get("type")
        parallel = not choice.get("disable_parallel_tool_use", False)
        if kind == "tool":
            if not isinstance(choice.get("name"), str):
                raise InvalidRequestError("tool_choice.name is required with type 'tool'", "tool_choice.name")
            return {"type": "function", "function": {"name": choice["name"]}}, parallel
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if mapped is None:
            raise InvalidRequestError(f"tool_choice.type {kind!r} is not one of 'auto', 'any', 'tool', 'none'",
                                      "tool_choice.type")
        return mapped, parallel

    def conversation(self) -> tuple[list[ChatMessage], str]:
        """(chat messages, the prefill a last assistant turn gives the answer)."""
        messages = _system_messages(self.system)
        for index, message in enumerate(self.messages):
            where = f"messages.{index}"
            if message.role == "user":
                messages.extend(_user_messages(message.content, where))
            else:
                messages.append(_assistant_message(message.content, where))
        prefix = ""
        last = messages[-1]
        if last.role == "assistant" and not last.tool_calls:
            prefix = last.content or ""
            messages.pop()
        return messages, prefix


class MessagesRequest(CountTokensRequest):
    """Body of POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[StrictStr] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None

    def constraint(self) -> ConstraintSource | None:
        """`output_config.format` (`{"type": "json_schema", "schema": {...}}`) as an output constraint."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequestError("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                                      "output_config.format")
        return ConstraintSource(StructuredOutputsParams(json=fmt["schema"]), "output_config.format")


def _system_messages(system: str | list[dict] | None) -> list[ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _block_texts(system, "system")
    return [ChatMessage(role="system", content=text)] if text else []


def _block_texts(blocks: list[Any], where: str) -> str:
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise UnsupportedFeatureError(f"{where}.{index}", f"{where}.{index}: block type {kind!r} is not "
                                          "supported here (text blocks only)")
        texts.append(_text_of(block, f"{where}.{index}"))
    return "".join(texts)


def _text_of(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"{where}.text must be a string", f"{where}.text")
    return block["text"]


def _blocks(content: str | list[dict], where: str) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _user_messages(content: str | list[dict], where: str) -> list[ChatMessage]:
    """A user turn: a "tool" message per tool_result block, a user message for its text."""
    messages: list[ChatMessage] = []
    texts: list[str] = []
    for index, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        block_where = f"{where}.content.{index}"
        if kind == "text":
            texts.append(_text_of(block, block_where))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise InvalidRequestError(f"{block_where}.tool_use_id must be a non-empty string",
                                          f"{block_where}.tool_use_id")
            result = block.get("content", "")
            text = result if isinstance(result, str) else _block_texts(result, f"{block_where}.content") \
                if isinstance(result, list) else None
            if text is None:
                raise InvalidRequestError(f"{block_where}.content must be a string or text blocks",
                                          f"{block_where}.content")
            messages.append(ChatMessage(role="tool", content=text, tool_call_id=tool_use_id))
        else:
            raise UnsupportedFeatureError(block_where, f"{block_where}: block type {kind!r} is not supported in a "
                                          "user turn (kvserve takes text and tool_result)")
    if texts or not messages:
        messages.append(ChatMessage(role="user", content="".join(texts)))
    return messages


def _assistant_message(content: str | list[dict], where: str) -> ChatMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    calls = []
    for index, block in enumerate(_blocks(content, where)):
        kind = block.get("type")
        block_where = f"{where}.content.{index}"
        if kind == "text":
            texts.append(_text_of(block, block_where))
        elif kind == "tool_use":
            calls.append(_call_of(block, block_where))
        elif kind == "thinking":
            thoughts.append(_thinking_of(block, block_where))
        elif kind not in _SKIPPED_BLOCKS:
            raise UnsupportedFeatureError(block_where, f"{block_where}: block type {kind!r} is not supported in an "
                                          "assistant turn (kvserve takes text, thinking and tool_use)")
    return ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None,
                       reasoning_content="\n".join(t for t in thoughts if t) or None)


def _thinking_of(block: dict, where: str) -> str:
    """A thinking block's text, its signature checked to be the one kvserve gave it."""
    thinking, signature = block.get("thinking"), block.get("signature")
    if not isinstance(thinking, str):
        raise InvalidRequestError(f"{where}.thinking must be a string", f"{where}.thinking")
    if not isinstance(signature, str) or not hmac.compare_digest(signature, thinking_signature(thinking)):
        raise InvalidRequestError(f"{where}: invalid `signature` in `thinking` block", f"{where}.signature")
    return thinking


def _call_of(block: dict, where: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise InvalidRequestError(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    if not isinstance(block.get("input"), dict):
        raise InvalidRequestError(f"{where}.input must be an object", f"{where}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}
