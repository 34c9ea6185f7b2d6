"""Prompt-lookup (n-gram) drafts: continue the request's tokens the way they went before."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int] | np.ndarray, min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to `num_tokens` draft tokens for the sequence `token_ids`.

    The longest suffix of `max_n` down to `min_n` tokens that also occurs
    earlier in the sequence wins; the draft is what followed its latest
    earlier occurrence. Returns [] when no suffix of `min_n` tokens recurs.
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if num_tokens <= 0 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows start at 0 .. length-1-n: every earlier occurrence, never the suffix itself.
        windows = sliding_window_view(tokens[:length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            begin = int(starts[-1]) + n
            return tokens[begin:begin + num_tokens].tolist()
    return []
