"""A reply that writes its reasoning in a `<think>...</think>` block (Qwen3, DeepSeek-R1 and the
models that follow them), read into reasoning and answer, whole or streamed.

A model reasons this way when its tokenizer has `<think>` and `</think>` as tokens of their own.
The block opens the reply (`<think>` its first text), or the prompt opened it already (chat
templates whose generation prompt ends with `<think>`): the reasoning then runs to `</think>`,
without the newline either side of it that the templates write. A block that never closes
(the reply cut at max_tokens) is all reasoning; a reply that does not open one is all answer.
The answer is what follows `</think>`, its leading whitespace dropped; it is read for tool calls
as any reply is.
"""
from __future__ import annotations

from typing import Any, Sequence

from kvserve.server.tool_stream import ToolCallStreamer, held_back_prefix

THINK_START, THINK_END = "<think>", "</think>"


def think_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """(id of `<think>`, id of `</think>`) when the tokenizer has both as tokens of their own, else None."""
    added = getattr(tokenizer, "get_added_vocab", None)
    vocab = added() if callable(added) else {}
    if THINK_START not in vocab or THINK_END not in vocab:
        return None
    return vocab[THINK_START], vocab[THINK_END]


def prompt_opens_thinking(prompt_token_ids: Sequence[int], ids: tuple[int, int]) -> bool:
    """Whether the prompt ends inside a think block (its last `<think>` after its last `</think>`)."""
    start, end = ids
    last = {start: -1, end: -1}
    for position, token in enumerate(prompt_token_ids):
        if token in last:
            last[token] = position
    return last[start] > last[end]


def split_thinking(text: str, opened: bool, final: bool) -> tuple[str, str]:
    """(reasoning, answer) that `text`, the reply so far, certainly says; `opened`: the prompt
    opened the block. Unless `final`, what may still become `</think>` (or, before anything
    else, `<think>`) is held back."""
    start = 0
    if not opened:
        body = text.lstrip()
        if not body.startswith(THINK_START):
            if not final and THINK_START.startswith(body):
                return "", ""
            return "", text
        start = len(text) - len(body) + len(THINK_START)
    end = text.find(THINK_END, start)
    if end < 0:
        reasoning = text[start:]
        held = 0 if final else held_back_prefix(reasoning, "\n" + THINK_END)
        return _trim(reasoning[:len(reasoning) - held]), ""
    return _trim(text[start:end]), text[end + len(THINK_END):].lstrip()


def _trim(reasoning: str) -> str:
    """The reasoning without the newline the templates write after `<think>` and before `</think>`."""
    reasoning = reasoning.removeprefix("\n")
    return reasoning.removesuffix("\n")


class ThinkStreamer:
    """The Chat Completions deltas of one streamed think-block reply: `reasoning_content`, then
    the answer, as `content` or through `calls` (a `ToolCallStreamer`) when the request may
    call tools."""

    def __init__(self, opened: bool, calls: ToolCallStreamer | None) -> None:
        self.opened = opened
        self.calls = calls
        self._reasoning_sent = 0
        self._content_sent = 0
        self.finished = False

    @property
    def sent_calls(self) -> bool:
        return self.calls is not None and self.calls.sent_calls

    def update(self, text: str) -> list[dict]:
        """Deltas for what became certain in `text` (the choice's whole text so far)."""
        return self._deltas(*split_thinking(text, self.opened, final=False), final=False)

    def finish(self, text: str) -> list[dict]:
        """The remaining deltas once the choice finished."""
        self.finished = True
        return self._deltas(*split_thinking(text, self.opened, final=True), final=True)

    def _deltas(self, reasoning: str, answer: str, final: bool) -> list[dict]:
        deltas = []
        if len(reasoning) > self._reasoning_sent:
            deltas.append({"reasoning_content": reasoning[self._reasoning_sent:]})
            self._reasoning_sent = len(reasoning)
        if self.calls is not None:
            return deltas + (self.calls.finish(answer) if final else self.calls.update(answer))
        if len(answer) > self._content_sent:
            deltas.append({"content": answer[self._content_sent:]})
            self._content_sent = len(answer)
        return deltas
