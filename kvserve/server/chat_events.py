"""A streamed chat answer as API-neutral events, for the Responses and Messages streams.

`ChatEventReader` reads one completion's successive outputs and says what became
certain since the last one: reasoning, text, a tool call starting (its id and name), more
of a call's arguments. With tools, the text goes through the same `ToolCallStreamer` as
Chat Completions' `delta.tool_calls`, so every API streams the calls the non-streamed
answer (`parsed_reply`) holds. `StreamedMessage` adds the events up into the final
reasoning, content and calls, whose ids are the ones streamed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.outputs import CompletionOutput
from kvserve.server.harmony_reply import HarmonyStreamer
from kvserve.server.think_reply import ThinkStreamer
from kvserve.server.tool_stream import ToolCallStreamer
from kvserve.server.tools import ToolCall, ToolRequest

ReplyStreamer = ToolCallStreamer | HarmonyStreamer | ThinkStreamer


def reply_streamer(tool_request: ToolRequest | None) -> ReplyStreamer | None:
    """What reads a streamed reply into deltas, or None when its text is passed on as it comes."""
    if tool_request is None or not tool_request.parses_reply:
        return None
    if tool_request.parser == "harmony":
        return HarmonyStreamer(tool_request.parses_calls)
    calls = ToolCallStreamer(tool_request.parser, tool_request.parallel) if tool_request.parses_calls else None
    if tool_request.reads_thinking:
        return ThinkStreamer(tool_request.thinking_open, calls)
    return calls


@dataclass(frozen=True)
class TextDelta:
    """More answer text."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """More reasoning text (harmony's analysis channel, a think block)."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    """Tool call number `index` begins: its id and function name are known."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of the JSON text of call number `index`'s arguments."""

    index: int
    text: str


ChatEvent = TextDelta | ReasoningDelta | CallStarted | ArgumentsDelta


@dataclass
class StreamedMessage:
    """The reasoning, content and calls streamed so far."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""

    def add(self, event: ChatEvent) -> None:
        if isinstance(event, TextDelta):
            self.content += event.text
        elif isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, CallStarted):
            self.calls.append(ToolCall(event.name, "", event.call_id))
        else:
            self.calls[event.index].arguments += event.text


class ChatEventReader:
    """The events of one streamed completion, from its cumulative outputs."""

    def __init__(self, tool_request: ToolRequest | None) -> None:
        self._streamer = reply_streamer(tool_request)
        self._text_sent = 0
        self.message = StreamedMessage()
        self.finished = False

    def update(self, completion: CompletionOutput) -> list[ChatEvent]:
        """Events for what `completion` (the whole output so far) adds; the last ones once it finished."""
        if self.finished:
            return []
        self.finished = completion.finish_reason is not None
        text = completion.text or ""
        if self._streamer is None:
            events: list[ChatEvent] = [TextDelta(text[self._text_sent:])] if len(text) > self._text_sent else []
            self._text_sent = max(self._text_sent, len(text))
        else:
            deltas = self._streamer.finish(text) if self.finished else self._streamer.update(text)
            events = [event for delta in deltas for event in _events_of(delta)]
        for event in events:
            self.message.add(event)
        return events

    @property
    def called(self) -> bool:
        return bool(self.message.calls)


def _events_of(delta: dict) -> list[ChatEvent]:
    """The events of one Chat Completions delta from a `ReplyStreamer`."""
    if "reasoning_content" in delta:
        return [ReasoningDelta(delta["reasoning_content"])] if delta["reasoning_content"] else []
    if "content" in delta:
        return [TextDelta(delta["content"])] if delta["content"] else []
    events: list[ChatEvent] = []
    for call in delta.get("tool_calls", []):
        function = call.get("function", {})
        if "id" in call:
            events.append(CallStarted(call["index"], call["id"], function["name"]))
        if function.get("arguments"):
            events.append(ArgumentsDelta(call["index"], function["arguments"]))
    return events
