"""A harmony reply (gpt-oss) read into reasoning, content and tool calls, whole or streamed.

The reply continues the prompt's `<|start|>assistant`, so its first message has no
`<|start|>`: `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
<|message|>...<|return|>`. Each message's header names its channel and, for a call, its
recipient (`to=functions.NAME`, in the role or the channel part). What goes where:
- `analysis` -> `reasoning_content`; so does a message to a built-in tool (`to=browser.*`,
  `to=python`), which kvserve does not run;
- `final`, and `commentary` without a recipient (a preamble to calls) -> content;
- a message to `functions.NAME` -> a tool call (its arguments: the message's text), or
  content when the request may not call tools.
Text outside any well-formed header (a model not writing harmony) is content. Messages of
one kind are joined with a newline.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvserve.server.harmony import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, SPECIAL_TOKENS, START
from kvserve.server.tool_stream import PartialCall, held_back_prefix
from kvserve.server.tools import ToolCall

_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
# A header longer than this without `<|message|>` is not harmony: it is shown as content.
MAX_HEADER_CHARS = 256
# How a reply's header begins: its channel, or the role part (recipient, or role after <|start|>).
_HEADER_OPENINGS = (CHANNEL, " to=", "assistant")


@dataclass
class HarmonyMessage:
    """One message of a reply: its channel, recipient, text, and whether its end was read."""

    channel: str
    recipient: str | None
    text: str
    complete: bool


@dataclass
class Reply:
    """A reply split by channel; `calls` hold each call's arguments as far as written."""

    reasoning: str = ""
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


def read_messages(text: str, final: bool) -> tuple[list[HarmonyMessage], str]:
    """(the messages of `text`, the text from where it stops being harmony). Unless `final`,
    a message's text stops before an end that could still be a marker being written."""
    messages: list[HarmonyMessage] = []
    pos = 0
    while pos < len(text):
        header_start = pos + len(START) if text.startswith(START, pos) else pos
        header_end = text.find(MESSAGE, header_start)
        complete = header_end >= 0
        header = text[header_start:header_end] if complete else text[header_start:]
        if not _is_header(header, complete):
            return messages, text[pos:]
        if not complete:
            return messages, ""  # a header being written, or cut off: nothing to show
        channel_part = header.split(CHANNEL, 1)[1].replace(CONSTRAIN, " ").split()
        recipient = _RECIPIENT.search(header)
        body_start = header_end + len(MESSAGE)
        body_end, marker = _message_end(text, body_start)
        message = HarmonyMessage(channel_part[0] if channel_part else "",
                                 recipient.group(1) if recipient else None, "", body_end >= 0)
        messages.append(message)
        if body_end < 0:
            body = text[body_start:]
            held = 0 if final else max(held_back_prefix(body, m) for m in SPECIAL_TOKENS)
            message.text = body[:len(body) - held]
            return messages, ""
        message.text = text[body_start:body_end]
        pos = body_end + len(marker)
        if marker in (RETURN, CALL):
            return messages, text[pos:] if final else ""
    return messages, ""


def _is_header(header: str, complete: bool) -> bool:
    """Whether `header` is (or, unless `complete`, may still become) a harmony header."""
    if len(header) > MAX_HEADER_CHARS or any(marker in header for marker in (END, RETURN, CALL)):
        return False
    if complete:
        return CHANNEL in header and header.startswith(_HEADER_OPENINGS)
    return header.startswith(_HEADER_OPENINGS) or any(o.startswith(header) for o in _HEADER_OPENINGS)


def _message_end(text: str, start: int) -> tuple[int, str]:
    """(index, marker) of the first end marker from `start` on; (-1, "") when none."""
    found = [(text.find(marker, start), marker) for marker in (END, RETURN, CALL, START)]
    found = [(index, marker) for index, marker in found if index >= 0]
    return min(found) if found else (-1, "")


def split_reply(text: str, parses_calls: bool, final: bool) -> Reply:
    """The reply `text` says so far, by channel (see the module docstring)."""
    messages, rest = read_messages(text, final)
    reasoning, content, calls = [], [], []
    for message in messages:
        recipient = message.recipient or ""
        if recipient.startswith("functions."):
            if parses_calls:
                calls.append(PartialCall(recipient[len("functions."):], message.text, message.complete))
            else:
                content.append(message.text)
        elif message.channel == "analysis" or recipient:
            reasoning.append(message.text)
        else:
            content.append(message.text)
    if rest:
        content.append(rest)
    return Reply("\n".join(reasoning), "\n".join(content), calls)


def parse_reply(text: str, parses_calls: bool) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, tool calls) of a finished reply."""
    reply = split_reply(text, parses_calls, final=True)
    return reply.reasoning, reply.content, [ToolCall(call.name, call.arguments) for call in reply.calls]


@dataclass
class _Sent:
    reasoning: int = 0
    content: int = 0
    call_ids: list[str] = field(default_factory=list)
    arguments: list[int] = field(default_factory=list)


class HarmonyStreamer:
    """The Chat Completions deltas of one streamed harmony reply: `reasoning_content`,
    `content` and `tool_calls` pieces, each sent once it is certain."""

    def __init__(self, parses_calls: bool) -> None:
        self.parses_calls = parses_calls
        self._sent = _Sent()
        self.finished = False

    @property
    def sent_calls(self) -> bool:
        return bool(self._sent.call_ids)

    def update(self, text: str) -> list[dict]:
        """Deltas for what became certain in `text` (the choice's whole text so far)."""
        return self._deltas(split_reply(text, self.parses_calls, final=False))

    def finish(self, text: str) -> list[dict]:
        """The remaining deltas once the choice finished."""
        self.finished = True
        return self._deltas(split_reply(text, self.parses_calls, final=True))

    def _deltas(self, reply: Reply) -> list[dict]:
        deltas, sent = [], self._sent
        if len(reply.reasoning) > sent.reasoning:
            deltas.append({"reasoning_content": reply.reasoning[sent.reasoning:]})
            sent.reasoning = len(reply.reasoning)
        if len(reply.content) > sent.content:
            deltas.append({"content": reply.content[sent.content:]})
            sent.content = len(reply.content)
        for index, call in enumerate(reply.calls):
            if index == len(sent.call_ids):
                sent.call_ids.append(ToolCall(call.name, "").id)
                sent.arguments.append(0)
                deltas.append({"tool_calls": [{"index": index, "id": sent.call_ids[index], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > sent.arguments[index]:
                deltas.append({"tool_calls": [{"index": index, "function": {
                    "arguments": call.arguments[sent.arguments[index]:]}}]})
                sent.arguments[index] = len(call.arguments)
        return deltas
