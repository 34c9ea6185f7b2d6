"""The short causal depthwise convolution of recurrent layers (Gated DeltaNet, Mamba-2),
over a flat batch of requests that each carry the convolution's state.

State of one request: its last `K - 1` inputs, [K - 1, channels] (oldest first; zeros
before its first token), K the kernel width. Output of token t, channel c:
act(sum_j w[c, j] * window_t[j, c] (+ bias[c])), `window_t` the K inputs ending at t
(state rows first). The state after token n is the K - 1 inputs ending at n.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _padded_inputs(x: torch.Tensor, states: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
    """Each request's state rows then its inputs, requests one after another:
    [T + B * (K - 1), channels]."""
    parts = []
    for r in range(len(query_start_loc) - 1):
        parts += [states[r].to(x.dtype), x[query_start_loc[r]:query_start_loc[r + 1]]]
    return torch.cat(parts)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, query_start_loc: list[int],
                  bias: torch.Tensor | None = None, activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [T, C], padded inputs) for a flat batch x [T, C] of B requests (request r's tokens
    are rows query_start_loc[r]:query_start_loc[r + 1]), `weight` [C, K], `states` [B, K - 1, C]
    (each request's state before its first token). Pass the padded inputs to `state_after`."""
    width = weight.shape[-1]
    padded = _padded_inputs(x, states, query_start_loc)
    # Token i of request r sits at padded row query_start_loc[r] + r * (K - 1) + (K - 1) + i.
    lens = torch.tensor([query_start_loc[r + 1] - query_start_loc[r] for r in range(len(query_start_loc) - 1)])
    shift = torch.repeat_interleave(torch.arange(len(lens)) * (width - 1), lens)
    last = torch.arange(x.shape[0]) + shift + (width - 1)
    windows = padded[last.unsqueeze(1) + torch.arange(1 - width, 1)]  # [T, K, C]
    out = (windows * weight.t().to(x.dtype)).sum(dim=1)
    if bias is not None:
        out = out + bias
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported convolution activation {activation!r}")
    return out, padded


def state_after(padded: torch.Tensor, query_start_loc: list[int], request: int, num_tokens: int,
                width: int) -> torch.Tensor:
    """The convolution state [K - 1, C] of `request` after its first `num_tokens` tokens of the
    step (0: the state it came in with), from `causal_conv1d`'s padded inputs."""
    start = query_start_loc[request] + request * (width - 1) + num_tokens
    return padded[start:start + width - 1]
