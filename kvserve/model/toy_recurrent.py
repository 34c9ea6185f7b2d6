"""A test-only recurrent layer ("toy_recurrent"): a decaying running sum behind a
width-2 causal conv, to test the state group end to end before the real families.

No checkpoint reaches it: configuration parsing never yields this layer type; only
a `ModelConfig` built in Python does. Per channel, with u, g = in_proj(x):
    v_t = u_t + c * u_{t-1},   s_t = a * s_{t-1} + v_t,   y_t = s_t * silu(g_t)
(a = sigmoid(decay_logit), u_{-1} = 0, s_{-1} = 0) and out = o_proj(y). Its state
is (u_{t-1} as [1, d], s_t as [d]). `forward` runs the chunked form (a decay
matrix per chunk); `reference` runs the recurrence token by token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention.metadata import StateMetadata
from kvserve.model.state_layers import StateMixer, read_states, register_state_layer, write_token_index

CHUNK_LEN = 16


@register_state_layer("toy_recurrent", "toy_mixer")
class ToyRecurrentMixer(StateMixer):
    """The toy mixer (see the module docstring); test-only."""

    def __init__(self, config, layer_idx: int, tp) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError("the toy recurrent layer does not run under tensor parallelism")
        width = config.hidden_size
        self.width = width
        self.in_proj = nn.Linear(width, 2 * width, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(width), requires_grad=False)
        self.decay_logit = nn.Parameter(torch.zeros(width), requires_grad=False)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((1, self.width), (self.width,))

    def forward(self, hidden: torch.Tensor, metadata: StateMetadata,
                state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        conv_cache, sum_cache = state
        prev_inputs = read_states(conv_cache, metadata.read_slot)[:, 0]
        sums = read_states(sum_cache, metadata.read_slot)
        u, g = self.in_proj(hidden).chunk(2, dim=-1)
        decay = torch.sigmoid(self.decay_logit)
        running = torch.empty_like(u)
        starts = metadata.query_start_loc.tolist()
        for req, (lo, hi) in enumerate(zip(starts, starts[1:])):
            if hi == lo:
                continue
            inputs = u[lo:hi]
            shifted = torch.cat([prev_inputs[req:req + 1], inputs[:-1]])
            running[lo:hi] = _scan(inputs + self.conv_weight * shifted, decay, sums[req])
        rows = write_token_index(metadata)
        conv_cache[metadata.write_slot] = u[rows].unsqueeze(1).to(conv_cache.dtype)
        sum_cache[metadata.write_slot] = running[rows].to(sum_cache.dtype)
        return self.o_proj(running * F.silu(g))

    @torch.inference_mode()
    def reference(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer over one whole sequence [L, hidden] from the zero state, token by token."""
        u, g = self.in_proj(hidden).chunk(2, dim=-1)
        decay = torch.sigmoid(self.decay_logit)
        prev_input = torch.zeros_like(u[0])
        total = torch.zeros_like(u[0])
        outputs = []
        for t in range(len(u)):
            total = decay * total + u[t] + self.conv_weight * prev_input
            prev_input = u[t]
            outputs.append(total * F.silu(g[t]))
        return self.o_proj(torch.stack(outputs))


def _scan(values: torch.Tensor, decay: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
    """s_t = decay * s_{t-1} + values_t from s_{-1} = initial, chunk by chunk: [L, d]."""
    log_decay = torch.log(decay)
    out = torch.empty_like(values)
    state = initial
    for lo in range(0, len(values), CHUNK_LEN):
        chunk = values[lo:lo + CHUNK_LEN]
        steps = torch.arange(len(chunk), device=values.device, dtype=values.dtype)
        lag = steps[:, None] - steps[None, :]  # t - k
        weights = torch.exp(lag.clamp(min=0)[..., None] * log_decay) * (lag >= 0)[..., None]  # [t, k, d]
        out[lo:lo + len(chunk)] = torch.exp((steps[:, None] + 1) * log_decay) * state + (weights * chunk).sum(1)
        state = out[lo + len(chunk) - 1]
    return out
