"""Mamba-2 token mixing as pure functions: the short causal conv1d and the selective
state-space scan (SSD), for one decode token per request and for a prompt chunk.

Shapes (one layer): H heads of P channels, a state of N per channel, G groups of B/C
(heads h share group h // (H / G)), a depthwise conv of K taps over the conv channels
`conv_dim = H*P + 2*G*N` (x, then B, then C). A request's state is
- the conv state [K-1, conv_dim]: its last K-1 conv inputs (zeros before its first token);
- the SSM state [H, P, N].

Per token t, with dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), A = -exp(A_log):
    xBC = silu(conv1d(inputs up to t) + conv_bias)          (split into x [H,P], B [G,N], C [G,N])
    h_t = exp(dt * A) h_{t-1} + dt * x ⊗ B                   ([H, P, N])
    y_t = h_t · C + D * x                                     ([H, P])
Every function computes in float32 and returns new states (float32); inputs are left alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model.linear_attention.causal_conv import causal_conv1d, state_after

# Prefill tokens per SSD chunk: the intra-chunk part costs O(chunk^2) per head, the
# inter-chunk recurrence one state update per chunk.
SSD_CHUNK = 64


@dataclass(frozen=True)
class Mamba2Shape:
    """The dimensions of one Mamba-2 layer."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba heads {self.num_heads} are not a multiple of its groups {self.n_groups}")
        if self.conv_kernel < 2:
            raise ValueError(f"mamba conv kernel must be >= 2, got {self.conv_kernel}")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.n_groups * self.state_size

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, SSM state) shapes of one request."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)


@dataclass
class Mamba2Params:
    """A layer's SSM parameters, float32: conv weight [conv_dim, K], conv bias [conv_dim]
    (or None), dt bias [H], A = -exp(A_log) [H], D [H], and dt's clamp range."""

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A: torch.Tensor
    D: torch.Tensor
    dt_min: float = 0.0
    dt_max: float = float("inf")

    def time_step(self, dt_raw: torch.Tensor) -> torch.Tensor:
        """clamp(softplus(dt_raw + dt_bias)) in float32, [..., H]."""
        return F.softplus(dt_raw.float() + self.dt_bias).clamp(self.dt_min, self.dt_max)


def _split_xbc(shape: Mamba2Shape, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., H, P], B [..., H, N], C [..., H, N] (B and C repeated over their group's heads)."""
    lead = xbc.shape[:-1]
    gn = shape.n_groups * shape.state_size
    x, b, c = xbc.split([shape.inner_size, gn, gn], dim=-1)
    per_group = shape.num_heads // shape.n_groups
    b = b.reshape(*lead, shape.n_groups, 1, shape.state_size).expand(*lead, shape.n_groups, per_group,
                                                                     shape.state_size)
    c = c.reshape(*lead, shape.n_groups, 1, shape.state_size).expand(*lead, shape.n_groups, per_group,
                                                                     shape.state_size)
    return (x.reshape(*lead, shape.num_heads, shape.head_dim),
            b.reshape(*lead, shape.num_heads, shape.state_size), c.reshape(*lead, shape.num_heads, shape.state_size))


def decode_step(shape: Mamba2Shape, params: Mamba2Params, xbc: torch.Tensor, dt_raw: torch.Tensor,
                conv_state: torch.Tensor, ssm_state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token for each of B requests: xbc [B, conv_dim] (the conv's input), dt_raw [B, H],
    conv_state [B, K-1, conv_dim], ssm_state [B, H, P, N] -> (y [B, H*P] float32 before the
    gated norm, D skip included; new conv state; new SSM state)."""
    one_each = list(range(len(xbc) + 1))
    conv, padded = causal_conv1d(xbc.float(), params.conv_weight, conv_state.float(), one_each, params.conv_bias)
    x, b, c = _split_xbc(shape, conv)
    dt = params.time_step(dt_raw)  # [B, H]
    decay = torch.exp(dt * params.A)[:, :, None, None]
    state = ssm_state.float() * decay + (dt[:, :, None] * x)[..., None] * b[:, :, None, :]
    y = (state @ c.unsqueeze(-1)).squeeze(-1) + params.D[:, None] * x
    new_conv = padded.reshape(len(xbc), shape.conv_kernel, shape.conv_dim)[:, 1:].contiguous()
    return y.reshape(len(xbc), shape.inner_size), new_conv, state


def prefill(shape: Mamba2Shape, params: Mamba2Params, xbc: torch.Tensor, dt_raw: torch.Tensor,
            conv_state: torch.Tensor, ssm_state: torch.Tensor, write_after: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L tokens of one request from its states: xbc [L, conv_dim], dt_raw [L, H], conv_state
    [K-1, conv_dim], ssm_state [H, P, N] -> (y [L, H*P] float32, the conv states [W, K-1,
    conv_dim] and SSM states [W, H, P, N] after token `write_after[i]` (1..L, ascending) of
    the chunk, for each i).

    The SSM runs in the chunked (SSD) form within each segment between two snapshot points:
    the snapshots then fall on segment ends, where the chunked form has its states."""
    length = len(xbc)
    if list(write_after) != sorted(set(write_after)) or (write_after and not 1 <= write_after[0] <= write_after[-1]
                                                          <= length):
        raise ValueError(f"write_after {write_after} must ascend within 1..{length}")
    conv, padded = causal_conv1d(xbc.float(), params.conv_weight, conv_state.float()[None], [0, length],
                                 params.conv_bias)
    x, b, c = _split_xbc(shape, conv)
    dt = params.time_step(dt_raw)
    conv_snapshots = torch.stack([state_after(padded, [0, length], 0, t, shape.conv_kernel) for t in write_after]) \
        if write_after else padded.new_zeros((0, shape.conv_kernel - 1, shape.conv_dim))
    ys, snapshots = [], []
    state = ssm_state.float()
    start = 0
    for end in sorted({*write_after, length}):
        y, state = ssd_scan(x[start:end], dt[start:end], params.A, b[start:end], c[start:end], state)
        ys.append(y)
        if end in write_after:
            snapshots.append(state)
        start = end
    y = torch.cat(ys) + params.D[:, None] * x
    ssm_snapshots = torch.stack(snapshots) if snapshots else state.new_zeros((0, *state.shape))
    return y.reshape(length, shape.inner_size), conv_snapshots, ssm_snapshots


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q]: out[..., t, s] = a[s+1] + ... + a[t] for s <= t (0 on the
    diagonal), -inf above it. Each is summed on its own (a cumsum down the masked columns),
    not taken as cumsum[t] - cumsum[s], a difference that would cancel the small terms."""
    q = a.shape[-1]
    ones = torch.ones(q, q, dtype=torch.bool, device=a.device)
    terms = a[..., :, None].expand(*a.shape, q).masked_fill(~ones.tril(-1), 0)  # [.., r, s] = a[r] if r > s
    return terms.cumsum(-2).masked_fill(~ones.tril(), float("-inf"))


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             state: torch.Tensor, chunk: int = SSD_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over L tokens in chunks: x [L, H, P], dt [L, H], A [H], b and c [L, H, N],
    state [H, P, N] -> (h_t · c_t [L, H, P] without the D skip, the state after token L)."""
    ys = []
    for start in range(0, len(x), chunk):
        end = min(start + chunk, len(x))
        xs, bs, cs = x[start:end], b[start:end], c[start:end]
        a = (dt[start:end] * A).t()  # [H, Q] log-decay of each token
        sums = _segment_sums(a)
        decay = torch.exp(sums)  # [H, Q(t), Q(s)]: exp(a[s+1] + ... + a[t])
        from_start = torch.exp(a.cumsum(-1))  # [H, Q]: decay from the chunk's start through t
        to_end = decay[:, -1, :]  # [H, Q]: decay from after s through the chunk's end
        xdt = xs * dt[start:end, :, None]  # [Q, H, P]
        scores = torch.einsum("thn,shn->hts", cs, bs) * decay  # [H, Q, Q]
        y = torch.einsum("hts,shp->thp", scores, xdt)
        y = y + torch.einsum("thn,hpn->thp", cs, state) * from_start.t()[:, :, None]
        ys.append(y)
        state = state * from_start[:, -1, None, None] + torch.einsum("sh,shp,shn->hpn", to_end.t(), xdt, bs)
    return torch.cat(ys), state
