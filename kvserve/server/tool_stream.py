"""Streamed tool calls: OpenAI `delta.tool_calls` sent while the model writes them.

`ToolCallStreamer` re-reads a choice's whole text at each update (outputs are
short) and sends what became certain since the last one: content that can no
longer turn into a call, then for each call its id, type and name as soon as
the name is complete, then its arguments as they grow. The arguments are the
model's own text of the JSON value (with a grammar-forced call, the compact
JSON the non-streamed response carries too). A call whose keys do not come as
`{"name": ..., "arguments"/"parameters": ...}` is held back and sent whole
when the choice finishes; so is anything the incremental reading cannot
place. A call cut off by `max_tokens` may have been partly sent already: the
finish reason (`length`) tells the client.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvserve.server.tools import ToolCall, extract_tool_calls

HERMES_OPEN = "<tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
LLAMA_PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\r\n"


@dataclass
class PartialCall:
    """A call as far as it is written: its name, and its arguments' text so far."""

    name: str
    arguments: str
    complete: bool


@dataclass
class Snapshot:
    """What a choice's text certainly holds so far: content, and calls in order."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


def _skip(text: str, pos: int, chars: str = _WHITESPACE) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """Index after the JSON string opening at `pos` (a quote), None when unterminated."""
    pos += 1
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
        elif text[pos] == '"':
            return pos + 1
        else:
            pos += 1
    return None


def json_value_end(text: str, pos: int) -> int | None:
    """Index after the JSON value starting at `pos`, None while it is unfinished."""
    if pos >= len(text):
        return None
    if text[pos] == '"':
        return _string_end(text, pos)
    if text[pos] not in "{[":
        end = pos
        while end < len(text) and text[end] not in ",}] \t\r\n;":
            end += 1
        return end if end < len(text) else None
    depth = 0
    while pos < len(text):
        char = text[pos]
        if char == '"':
            end = _string_end(text, pos)
            if end is None:
                return None
            pos = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return None


def _expect(text: str, pos: int, literal: str) -> int | None | bool:
    """After `literal` at `pos` (whitespace first): its end; None when the text ends inside
    it (could still match); False when it cannot match."""
    pos = _skip(text, pos)
    piece = text[pos:pos + len(literal)]
    if piece == literal:
        return pos + len(literal)
    return None if literal.startswith(piece) and pos + len(piece) == len(text) else False


def read_call_header(text: str, pos: int, args_keys: tuple[str, ...]) -> tuple[str, int] | None | bool:
    """`{"name": "<name>", "<args key>": ` at `pos`: (name, index of the arguments value);
    None when the text ends before it is decided; False when the call has another shape."""
    pos = _expect(text, pos, "{")
    for literal in ('"name"', ":"):
        if not pos:
            return pos
        pos = _expect(text, pos, literal)
    if not pos:
        return pos
    pos = _skip(text, pos)
    if pos >= len(text):
        return None
    if text[pos] != '"':
        return False
    name_end = _string_end(text, pos)
    if name_end is None:
        return None
    try:
        name = json.loads(text[pos:name_end])
    except json.JSONDecodeError:
        return False
    pos = _expect(text, name_end, ",")
    if not pos:
        return pos
    for key in args_keys:
        after_key = _expect(text, pos, f'"{key}"')
        if after_key is None:
            return None
        if after_key:
            after_colon = _expect(text, after_key, ":")
            if not after_colon:
                return after_colon
            value = _skip(text, after_colon)
            return (name, value) if value < len(text) else None
    return False


def read_calls(text: str, pos: int, opener: str, args_keys: tuple[str, ...]) -> list[PartialCall]:
    """The calls written from `pos` on, each one preceded by `opener` (or a JSON object
    after separators when `opener` is empty), up to the end or to a call of another
    shape (which the final parse then handles)."""
    calls: list[PartialCall] = []
    while True:
        if opener:
            found = text.find(opener, pos)
            if found < 0:
                return calls
            pos = found + len(opener)
        else:
            pos = _skip(text, pos, _WHITESPACE + ";,[")
            if pos >= len(text) or text[pos] == "]":
                return calls
        header = read_call_header(text, pos, args_keys)
        if not header:
            return calls
        name, value_start = header
        value_end = json_value_end(text, value_start)
        if value_end is None:
            calls.append(PartialCall(name, text[value_start:], False))
            return calls
        calls.append(PartialCall(name, text[value_start:value_end], True))
        close = _expect(text, value_end, "}")
        if not close:
            return calls
        pos = close


def held_back_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that starts `marker` (it may become the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def snapshot(parser: str, text: str, final: bool) -> Snapshot:
    """What `text` certainly says so far under `parser`'s call format."""
    if parser == "llama3_json":
        body = text.replace(LLAMA_PYTHON_TAG, "")
        start = _skip(body, 0)
        if not final and LLAMA_PYTHON_TAG.startswith(body[start:]):
            return Snapshot("")
        if start >= len(body):
            return Snapshot(text)
        if body[start] != "{":
            return Snapshot(text)
        calls = read_calls(body, start, "", ("parameters", "arguments"))
        return Snapshot("", calls)
    marker = HERMES_OPEN if parser == "hermes" else MISTRAL_MARKER
    found = text.find(marker)
    if found < 0:
        if parser == "mistral" and text.lstrip(_WHITESPACE)[:1] == "[":
            calls = read_calls(text, text.index("["), "", ("arguments",))
            return Snapshot("", calls)
        if final:
            return Snapshot(text)
        safe = text[:len(text) - held_back_prefix(text, marker)]
        return Snapshot(safe.rstrip(_WHITESPACE))
    content = text[:found].rstrip(_WHITESPACE)
    if parser == "hermes":
        calls = read_calls(text, found, HERMES_OPEN, ("arguments",))
    else:
        calls = read_calls(text, found + len(marker), "", ("arguments",))
    return Snapshot(content, calls)


@dataclass
class _SentCall:
    id: str
    arguments_sent: int


class ToolCallStreamer:
    """The OpenAI chat deltas of one streamed choice whose text may hold tool calls."""

    def __init__(self, parser: str, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel
        self._content_sent = 0
        self._calls: list[_SentCall] = []
        self.finished = False

    @property
    def sent_calls(self) -> bool:
        return bool(self._calls)

    def update(self, text: str) -> list[dict]:
        """Deltas for what became certain in `text` (the choice's whole text so far)."""
        return self._deltas(snapshot(self.parser, text, final=False))

    def finish(self, text: str) -> list[dict]:
        """The remaining deltas once the choice finished: the calls of a non-streamed
        response (`extract_tool_calls`), or the rest of the text as content when none."""
        self.finished = True
        _, parsed = extract_tool_calls(self.parser, text)
        if not parsed:
            # A call already under way was cut off (by max_tokens): nothing to add to it.
            return [] if self._calls else self._deltas(Snapshot(text))
        final = snapshot(self.parser, text, final=True)
        calls = []
        for index, call in enumerate(parsed):
            raw = final.calls[index] if index < len(final.calls) else None
            # The model's own text where it was read, so that it continues what was sent.
            same = raw is not None and raw.complete and raw.name == call.name
            calls.append(raw if same else PartialCall(call.name, call.arguments, True))
        return self._deltas(Snapshot(final.content, calls))

    def _deltas(self, snap: Snapshot) -> list[dict]:
        deltas = []
        if not self._calls and len(snap.content) > self._content_sent:
            deltas.append({"content": snap.content[self._content_sent:]})
            self._content_sent = len(snap.content)
        calls = snap.calls if self.parallel else snap.calls[:1]
        for index, call in enumerate(calls):
            if index == len(self._calls):
                sent = _SentCall(ToolCall(call.name, "").id, 0)
                self._calls.append(sent)
                deltas.append({"tool_calls": [{"index": index, "id": sent.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            sent = self._calls[index]
            if len(call.arguments) > sent.arguments_sent:
                deltas.append({"tool_calls": [{"index": index, "function": {
                    "arguments": call.arguments[sent.arguments_sent:]}}]})
                sent.arguments_sent = len(call.arguments)
        return deltas
