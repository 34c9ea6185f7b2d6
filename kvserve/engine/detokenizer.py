"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level and byte-fallback
vocabularies: one character may span several tokens, and a word-start marker
may only turn into a space given the token before it. So each step decodes a
short window twice, (prefix) and (prefix + new tokens), and emits the
difference once it no longer ends in U+FFFD (an incomplete UTF-8 sequence).
The window then slides forward, so the cost per token stays constant.
"""
from __future__ import annotations

from typing import Any, Sequence

from kvserve.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token, so the
# first output token's leading space / byte continuation come out right.
_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, step by step.

    `update(new_token_ids)` appends tokens and returns the stop string that
    ended the sequence, if one appeared (the text is then cut before it, or
    after it with `include_stop_str_in_output`). `get_next_output_text`
    returns the text that is safe to show: while streaming it holds back an
    incomplete character and any tail that could still become a stop string.
    Concatenated deltas equal `tokenizer.decode(prompt + outputs)` minus the
    decoded prompt (up to the stop string).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams | None = None) -> None:
        params = sampling_params or SamplingParams()
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes the same text without the
        # Python wrapper's overhead (about 15x faster per call); two decodes
        # run per generated token.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self._window_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        self._num_sent_chars = 0
        self._max_stop_len = max((len(s) for s in self.stop_strings), default=0)

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string found, else None.

        `stop_terminated`: the last token is an EOS / stop token id; it is kept
        in `token_ids` but its text is not added.
        """
        ids = list(new_token_ids)
        silent_last = stop_terminated and bool(ids)
        for position, token_id in enumerate(ids):
            self.token_ids.append(token_id)
            if silent_last and position == len(ids) - 1:
                break
            num_chars_before = len(self.output_text)
            self.output_text += self._decode_next(token_id)
            stop = self._check_stop_strings(num_chars_before)
            if stop is not None:
                return stop
        return None

    def flush(self) -> None:
        """At the end of the sequence: emit whatever the window still holds,
        even an incomplete character (as U+FFFD, like a full decode)."""
        pending = self._decode(self._window_ids[self._prefix_offset:])
        prefix = self._decode(self._window_ids[self._prefix_offset:self._read_offset])
        if len(pending) > len(prefix):
            self.output_text += pending[len(prefix):]
        self._prefix_offset = self._read_offset = len(self._window_ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show: all of it (`delta=False`) or what is new since the
        last call with `delta=True`. Holds back a possible stop-string start
        until `finished`."""
        end = len(self.output_text)
        if not finished and self.stop_strings and not self.include_stop_str_in_output:
            end -= self._stop_prefix_len()
        end = max(end, self._num_sent_chars)
        if not delta:
            return self.output_text[:end]
        text = self.output_text[self._num_sent_chars:end]
        self._num_sent_chars = end
        return text

    def _decode(self, token_ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_next(self, token_id: int) -> str:
        self._window_ids.append(token_id)
        prefix = self._decode(self._window_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._window_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            # Nothing printable yet (special token skipped, or a character
            # still missing bytes): keep the window and wait for more tokens.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window_ids)
        # Keep the window short: what lies before the prefix is never read again.
        if self._prefix_offset > 4 * _PROMPT_CONTEXT_TOKENS:
            del self._window_ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full[len(prefix):]

    def _check_stop_strings(self, num_chars_before: int) -> str | None:
        if not self.stop_strings or len(self.token_ids) <= self.min_tokens:
            return None
        if len(self.output_text) == num_chars_before:
            return None
        search_from = max(num_chars_before - self._max_stop_len + 1, 0)
        best_index, best_stop = -1, None
        for stop in self.stop_strings:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best_index == -1 or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        cut = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self.output_text = self.output_text[:cut]
        return best_stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that starts some stop string."""
        text = self.output_text
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
