"""The gated delta rule (Gated DeltaNet, Yang et al. 2024) as pure functions over one
sequence or a batch of one-token steps, in float32.

Per value head, with a key k_t (unit L2 norm in Qwen3-Next), a query q_t, a value v_t,
a log decay g_t <= 0 and a write strength beta_t in (0, 1), the state S [Dk, Dv] evolves

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,  delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)

and the output is o_t = S_t^T q_t. Everything is computed in float32 (float64 inputs stay
float64: the tests check the algebra that way). The recurrent form applies this token by token
(decode); the chunked form (prefill) gets the same states and outputs a chunk of C tokens
at a time with matrix products. Within a chunk, with G_t = g_1 + ... + g_t, unrolling gives

    delta_t + beta_t sum_{s<t} exp(G_t - G_s) (k_t . k_s) delta_s = beta_t (v_t - exp(G_t) S_0^T k_t)

a unit lower-triangular system for the chunk's deltas, then

    o_t = exp(G_t) S_0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) delta_s
    S_C = exp(G_C) S_0 + sum_s exp(G_C - G_s) k_s delta_s^T.

exp(G_t - G_s) is formed from the segment sum g_{s+1} + ... + g_t, not as a difference of
two running sums: with every g <= 0 the sum has no cancellation, so each decay factor is
good to a few units of rounding however long the chunk.

Both forms start from a given state and return the states after given token counts (the
snapshots a KV-cache group keeps at block boundaries, and the running state).
"""
from __future__ import annotations

import torch

CHUNK_SIZE = 64


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N sequences: q, k [N, H, Dk], v [N, H, Dv], g, beta [N, H],
    state [N, H, Dk, Dv] -> (outputs [N, H, Dv], the new states), float32."""
    q, k, v, g, beta, state = _compute_dtype(q, k, v, g, beta, state)
    decayed = state * g.exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ decayed).squeeze(-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    new_state = decayed + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (q.unsqueeze(-2) @ new_state).squeeze(-2)
    return out, new_state


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          state: torch.Tensor, snapshot_after: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state
    [H, Dk, Dv] (before its first token) -> (outputs [T, H, Dv], the states after
    each count in `snapshot_after` (0..T) [len(snapshot_after), H, Dk, Dv])."""
    wanted = _check_snapshots(snapshot_after, q.shape[0])
    state = _compute_dtype(state)[0].unsqueeze(0)
    outs, snapshots = [], {0: state[0]}
    for t in range(q.shape[0]):
        out, state = gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(out[0])
        if t + 1 in wanted:
            snapshots[t + 1] = state[0]
    out = torch.stack(outs) if outs else v.new_zeros(v.shape, dtype=state.dtype)
    return out, _stack_snapshots(snapshots, snapshot_after, state[0])


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, snapshot_after: list[int],
                        chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_recurrent` in chunks of up to `chunk_size` tokens; chunks also end at every
    snapshot count, so each snapshot is a chunk's final state."""
    num_tokens = q.shape[0]
    wanted = _check_snapshots(snapshot_after, num_tokens)
    ends = sorted(wanted | set(range(chunk_size, num_tokens, chunk_size)) | {num_tokens})
    q, k, v, g, beta, state = _compute_dtype(q, k, v, g, beta, state)
    q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v, g, beta))  # heads first
    outs, snapshots, start = [], {0: state}, 0
    for end in ends:
        if end == start:
            continue
        out, state = _chunk(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end],
                            beta[:, start:end], state)
        outs.append(out)
        snapshots[end] = state
        start = end
    out = torch.cat(outs, dim=1).transpose(0, 1) if outs else v.new_zeros(v.shape, dtype=state.dtype)
    return out, _stack_snapshots(snapshots, snapshot_after, state)


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, heads first: q, k [H, C, Dk], v [H, C, Dv], g, beta [H, C], state [H, Dk, Dv]
    -> (outputs [H, C, Dv], the state after the chunk). See the module docstring."""
    size = q.shape[1]
    index = torch.arange(size, device=q.device)
    causal, strict = index[:, None] >= index[None, :], index[:, None] > index[None, :]  # (torch.tril is slow here)
    # segment[h, t, s] = g_{s+1} + ... + g_t for s <= t: cumulative sums down each column.
    segment = (g.unsqueeze(-1) * strict).cumsum(dim=1)
    decay = segment.masked_fill(~causal, float("-inf")).exp()  # exp(G_t - G_s), 0 above the diagonal
    from_start = g.cumsum(dim=1).exp()  # exp(G_t)
    strictly_lower = beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * (decay * strict)
    system = strictly_lower + torch.eye(size, dtype=q.dtype, device=q.device)
    rhs = beta.unsqueeze(-1) * (v - from_start.unsqueeze(-1) * (k @ state))
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = from_start.unsqueeze(-1) * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ delta
    to_end = decay[:, -1, :]  # exp(G_C - G_s)
    new_state = from_start[:, -1, None, None] * state + (k * to_end.unsqueeze(-1)).transpose(-1, -2) @ delta
    return out, new_state


def _compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return tuple(t.to(dtype) for t in tensors)


def _check_snapshots(snapshot_after: list[int], num_tokens: int) -> set[int]:
    if any(not 0 <= n <= num_tokens for n in snapshot_after):
        raise ValueError(f"snapshot counts {snapshot_after} outside 0..{num_tokens}")
    return set(snapshot_after)


def _stack_snapshots(snapshots: dict[int, torch.Tensor], snapshot_after: list[int],
                     final: torch.Tensor) -> torch.Tensor:
    if not snapshot_after:
        return final.new_zeros((0, *final.shape))
    return torch.stack([snapshots[n] for n in snapshot_after])
