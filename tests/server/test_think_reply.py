"""Reading a `<think>` block reply (kvserve/server/think_reply.py): whole, streamed piece by
piece (what each step sends adds up to the whole reading), with the block opened by the
prompt, cut before it closes, or absent."""
from __future__ import annotations

import pytest

from kvserve.server.think_reply import ThinkStreamer, prompt_opens_thinking, split_thinking
from kvserve.server.tool_stream import ToolCallStreamer

REPLY = "<think>\nFirst this.\nThen that.\n</think>\n\nThe answer."


@pytest.mark.parametrize(("text", "opened", "expected"), [
    (REPLY, False, ("First this.\nThen that.", "The answer.")),
    ("\n" + REPLY, False, ("First this.\nThen that.", "The answer.")),
    ("First this.\n</think>\n\nThe answer.", True, ("First this.", "The answer.")),
    ("<think>\nCut in the midd", False, ("Cut in the midd", "")),  # max_tokens inside the block
    ("Cut in the midd", True, ("Cut in the midd", "")),
    ("No block here. <think>x</think>", False, ("", "No block here. <think>x</think>")),
    ("<think>\n\n</think>\n\nQuick.", False, ("", "Quick.")),
])
def test_split_thinking_whole(text, opened, expected):
    assert split_thinking(text, opened, final=True) == expected


@pytest.mark.parametrize("opened", [False, True])
def test_streamed_pieces_add_up_to_the_whole_reading(opened):
    text = REPLY.removeprefix("<think>") if opened else REPLY
    streamer = ThinkStreamer(opened, None)
    reasoning, content, seen = "", "", []
    for end in range(len(text) + 1):
        deltas = streamer.update(text[:end]) if end < len(text) else streamer.finish(text)
        for delta in deltas:
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
        seen.append((reasoning, content))
        # never more than is certain: a sent piece is a prefix of the whole reading
        assert "First this.\nThen that.".startswith(reasoning) and "The answer.".startswith(content)
    assert (reasoning, content) == ("First this.\nThen that.", "The answer.")
    assert ("First this.\nThen that", "") in seen  # the newline before </think> held until it is known


def test_answer_after_the_block_is_read_for_tool_calls():
    text = '<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    streamer = ThinkStreamer(False, ToolCallStreamer("hermes", parallel=True))
    deltas = [d for end in range(1, len(text)) for d in streamer.update(text[:end])] + streamer.finish(text)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Call it."
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "f" and streamer.sent_calls
    assert "".join(c["function"].get("arguments", "") for c in calls) == '{"x": 1}'
    assert not any(d.get("content") for d in deltas)


def test_prompt_opens_thinking_by_its_last_marker():
    ids = (7, 8)
    assert prompt_opens_thinking([1, 2, 7], ids)
    assert not prompt_opens_thinking([1, 7, 3, 8, 4], ids)
    assert prompt_opens_thinking([7, 8, 1, 7, 5], ids)
    assert not prompt_opens_thinking([1, 2, 3], ids)
