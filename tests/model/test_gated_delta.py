"""The gated delta rule's recurrent and chunked forms (kvserve.model.linear_attention.gated_delta)
against a float64 loop written in the other algebraic form of the rule,
S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, and the causal convolution
against torch's conv1d.

Error bound (first order in the unit roundoff u: 2**-24 in float32, 2**-53 in float64).
Keys have unit L2 norm, 0 < beta < 1 and g <= 0, so the exact map S -> exp(g_t)(I - beta k k^T) S
has operator norm <= exp(g_t): an error made at one token only shrinks later. Hence the state
norms obey ||S_t||_F <= M_t, M_t = exp(g_t) M_{t-1} + beta_t ||v_t|| (M_0 = ||S_0||_F).
One token's arithmetic (the decay product, the Dk-term dot product k^T S, the subtraction and
beta product, the outer-product add) errs by at most (Dk + 10) u (M_{t-1} + ||v_t||) in
Frobenius norm (Cauchy-Schwarz with ||k|| = 1 for the dot product, a few roundings for the
rest), so the state's error obeys E_t = exp(g_t) E_{t-1} + (Dk + 10) u (M_{t-1} + ||v_t||), and
the output o_t = S_t^T q_t adds a Dk-term dot product: |o_t - exact| <= ||q_t|| (E_t + (Dk + 1) u M_t).
The chunked form forms each chunk's deltas by a triangular solve of size C: its terms carry
C more roundings (the C-term products and decay sums, so Dk + C + 10 per token) and the solve
amplifies them by at most the Skeel condition number max || |L^-1| |L| ||_inf of the chunk's
matrices L (Higham, Accuracy and Stability of Numerical Algorithms, 8.2), which the test
measures on its data and multiplies the bound by.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.linear_attention.causal_conv import causal_conv1d, state_after
from kvserve.model.linear_attention.gated_delta import (gated_delta_chunked, gated_delta_recurrent,
                                                         gated_delta_step)

HEADS, DK, DV = 3, 16, 8
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


def _inputs(num_tokens: int, seed: int, dtype=torch.float32, strong_decay: bool = False, heads: int = HEADS,
            dv: int = DV):
    """Random q, k (unit norm), v, g, beta [T, H, ...] and a nonzero initial state [H, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, heads, DK, generator=gen, dtype=torch.float64) * DK ** -0.5
    k = F.normalize(torch.randn(num_tokens, heads, DK, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(num_tokens, heads, dv, generator=gen, dtype=torch.float64)
    # Qwen3-Next's decay: -exp(A_log) * softplus(a + dt_bias), A up to 16.
    scale = 16.0 if strong_decay else 1.0
    g = -scale * F.softplus(torch.randn(num_tokens, heads, generator=gen, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(num_tokens, heads, generator=gen, dtype=torch.float64))
    state = torch.randn(heads, DK, dv, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, g, beta, state))


def _reference(q, k, v, g, beta, state):
    """float64 outputs [T, H, Dv] and states after each token [T + 1, H, Dk, Dv] (index 0: the initial)."""
    q, k, v, g, beta, state = (t.double() for t in (q, k, v, g, beta, state))
    eye = torch.eye(DK, dtype=torch.float64)
    states, outs = [state], []
    for t in range(q.shape[0]):
        kt = k[t].unsqueeze(-1)  # [H, Dk, 1]
        b = beta[t][:, None, None]
        state = g[t].exp()[:, None, None] * ((eye - b * kt @ kt.transpose(-1, -2)) @ state) \
            + b * kt @ v[t].unsqueeze(-2)
        states.append(state)
        outs.append((q[t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outs), torch.stack(states)


def _bound(q, v, g, beta, state, dtype, extra_terms: int = 0, cond: float = 1.0) -> torch.Tensor:
    """The module docstring's bound on |o_t - exact| for each token and head, [T, H, 1], and on
    each state's error (max norm <= Frobenius norm), [T + 1, H]."""
    q, v, g, beta, state = (t.double() for t in (q, v, g, beta, state))
    u, per_token = UNIT_ROUNDOFF[dtype], DK + extra_terms + 10
    norm = state.flatten(1).norm(dim=-1)  # M_0 [H]
    error = torch.zeros_like(norm)
    out_bounds, state_bounds = [], [error]
    for t in range(q.shape[0]):
        v_norm = v[t].norm(dim=-1)
        error = g[t].exp() * error + per_token * u * (norm + v_norm)
        norm = g[t].exp() * norm + beta[t] * v_norm
        out_bounds.append(q[t].norm(dim=-1) * (error + (DK + extra_terms + 1) * u * norm))
        state_bounds.append(error)
    return cond * torch.stack(out_bounds).unsqueeze(-1), cond * torch.stack(state_bounds)


def _skeel_condition(k, g, beta, ends: list[int]) -> float:
    """max || |L^-1| |L| ||_inf over the chunks [start, end) and heads, L = I + the chunk's
    strictly lower beta_t exp(G_t - G_s) (k_t . k_s), in float64."""
    k, g, beta = k.double(), g.double(), beta.double()
    worst, start = 1.0, 0
    for end in ends:
        kc, gc, bc = k[start:end].transpose(0, 1), g[start:end].t(), beta[start:end].t()
        cum = gc.cumsum(-1)
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).tril(-1).exp().tril(-1)
        lower = torch.eye(end - start, dtype=torch.float64) + bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay
        amplification = torch.linalg.inv(lower).abs() @ lower.abs()
        worst = max(worst, amplification.sum(-1).max().item())
        start = end
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_recurrent_matches_float64_loop(dtype, strong_decay):
    q, k, v, g, beta, state = _inputs(70, seed=1, dtype=dtype, strong_decay=strong_decay)
    snapshots = [0, 1, 16, 32, 69, 70]
    out, states = gated_delta_recurrent(q, k, v, g, beta, state, snapshots)
    ref_out, ref_states = _reference(q, k, v, g, beta, state)
    assert out.dtype == dtype and states.shape == (len(snapshots), HEADS, DK, DV)
    out_bound, state_bound = _bound(q, v, g, beta, state, dtype)
    assert ((out.double() - ref_out).abs() <= out_bound).all()
    state_error = (states.double() - ref_states[snapshots]).abs().flatten(2).amax(-1)
    assert (state_error <= state_bound[snapshots]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunked_matches_float64_loop_with_snapshots(dtype, strong_decay):
    """150 tokens in chunks of 64, cut also at the snapshot counts (block boundaries of 16
    after a context of 5 tokens: 11, 27, ...), from a nonzero state."""
    q, k, v, g, beta, state = _inputs(150, seed=2, dtype=dtype, strong_decay=strong_decay)
    snapshots = [11, 27, 43, 59, 75, 91, 107, 123, 139, 150]
    out, states = gated_delta_chunked(q, k, v, g, beta, state, snapshots, chunk_size=64)
    ref_out, ref_states = _reference(q, k, v, g, beta, state)
    ends = sorted(set(snapshots) | {64, 128})
    cond = _skeel_condition(k, g, beta, ends)
    assert cond < 50  # the bound below stays meaningful
    out_bound, state_bound = _bound(q, v, g, beta, state, dtype, extra_terms=64, cond=cond)
    assert ((out.double() - ref_out).abs() <= out_bound).all()
    state_error = (states.double() - ref_states[snapshots]).abs().flatten(2).amax(-1)
    assert (state_error <= state_bound[snapshots]).all()
    # The bound is far below the outputs' size: a wrong term would not fit in it.
    assert out_bound.amax() < 1e-3 * ref_out.abs().amax()


def test_chunk_sizes_and_forms_agree():
    """Chunks of 1, 7 and 64 and the recurrent form give the same states within the bound."""
    q, k, v, g, beta, state = _inputs(40, seed=3)
    out_bound, state_bound = _bound(q, v, g, beta, state, torch.float32, extra_terms=64,
                                    cond=_skeel_condition(k, g, beta, [40]))
    reference, ref_states = gated_delta_recurrent(q, k, v, g, beta, state, [40])
    for chunk in (1, 7, 64):
        out, states = gated_delta_chunked(q, k, v, g, beta, state, [40], chunk_size=chunk)
        # each within its bound of the exact values, so within twice the bound of each other
        assert ((out - reference).abs() <= 2 * out_bound).all()
        assert (states - ref_states).abs().max() <= 2 * state_bound[-1].max()


def test_batched_step_is_the_recurrent_form():
    """N sequences one token each in one call: each row equals its own recurrent step exactly
    (the same operations per row)."""
    q, k, v, g, beta, _ = _inputs(5, seed=4)
    states = torch.randn(5, HEADS, DK, DV, generator=torch.Generator().manual_seed(5))
    out, new_states = gated_delta_step(q, k, v, g, beta, states)
    for n in range(5):
        one_out, one_state = gated_delta_recurrent(q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1],
                                                   beta[n:n + 1], states[n], [1])
        torch.testing.assert_close(out[n], one_out[0], rtol=0, atol=0)
        torch.testing.assert_close(new_states[n], one_state[0], rtol=0, atol=0)


def test_snapshot_of_zero_tokens_is_the_initial_state_and_bad_counts_fail():
    q, k, v, g, beta, state = _inputs(4, seed=6)
    for form in (gated_delta_recurrent, gated_delta_chunked):
        _, states = form(q, k, v, g, beta, state, [0, 4])
        assert torch.equal(states[0], state)
        with pytest.raises(ValueError, match="outside"):
            form(q, k, v, g, beta, state, [5])


def test_causal_conv_matches_conv1d_and_keeps_states():
    """Two requests of 5 and 1 tokens from random states: outputs equal torch's conv1d over
    the state rows then the inputs (within a 4-term sum's rounding), states after any count."""
    gen = torch.Generator().manual_seed(7)
    channels, width = 6, 4
    weight = torch.randn(channels, width, generator=gen)
    x = torch.randn(6, channels, generator=gen)
    states = torch.randn(2, width - 1, channels, generator=gen)
    starts = [0, 5, 6]
    out, padded = causal_conv1d(x, weight, states, starts)
    for r in range(2):
        full = torch.cat([states[r], x[starts[r]:starts[r + 1]]]).t().unsqueeze(0)
        ref = F.silu(F.conv1d(full, weight.unsqueeze(1), groups=channels)[0].t())
        # sum of K = 4 products: at most 4 * 2**-24 of sum |terms| each (then SiLU's own rounding)
        scale = (full.abs().max() * weight.abs().sum(-1).max()).item()
        assert (out[starts[r]:starts[r + 1]] - ref).abs().max() <= 8 * 2.0 ** -24 * scale
        for n in range(starts[r + 1] - starts[r] + 1):
            assert torch.equal(state_after(padded, starts, r, n, width), full[0].t()[n:n + width - 1])


@pytest.mark.parametrize("dv", [32, 12])
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_native_step_matches_float64_loop(isa, dv):
    """The C step (csrc/ssm/gated_delta_step.c) on each path this machine runs: 3 requests of
    20 one-token steps with 2 key heads serving 4 value heads, from zeros (slot -1), from a
    state in another slot and in place; every output and state within the module docstring's
    bound of the float64 loop. Dv = 12 is no multiple of the vector width: those paths fall
    back to portable C."""
    from kvserve.native import cpu_kernels, dispatch
    if cpu_kernels.load_library() is None or not dispatch.available("gated_delta", isa):
        pytest.skip(f"no {isa} path here")
    group, key_heads = 2, 2  # 4 value heads, each key head serving two
    runs = [_inputs(20, seed=s, heads=group * key_heads, dv=dv) for s in (11, 12, 13)]
    gen = torch.Generator().manual_seed(14)
    keys = [F.normalize(torch.randn(20, key_heads, DK, generator=gen), dim=-1) for _ in runs]
    queries = [torch.randn(20, key_heads, DK, generator=gen) * DK ** -0.5 for _ in runs]
    starts = [torch.zeros_like(runs[0][5]), runs[1][5], runs[2][5]]
    cache = torch.zeros(6, group * key_heads, DK, dv)
    cache[2], cache[4] = starts[1], starts[2]
    read, write = torch.tensor([-1, 2, 4]), torch.tensor([1, 3, 4])
    outs = []
    for t in range(20):
        step = [torch.stack([x[t] for x in xs]) for xs in (queries, keys, [run[2] for run in runs],
                                                            [run[3] for run in runs], [run[4] for run in runs])]
        outs.append(cpu_kernels.gated_delta_step(*step, cache, read, write, isa=isa))
        read = write
    for r in range(3):
        q = queries[r].repeat_interleave(group, dim=1)
        k = keys[r].repeat_interleave(group, dim=1)
        _, _, v, g, beta, _ = runs[r]
        ref_out, ref_states = _reference(q, k, v, g, beta, starts[r])
        out_bound, state_bound = _bound(q, v, g, beta, starts[r], torch.float32)
        ours = torch.stack([o[r] for o in outs])
        assert ((ours.double() - ref_out).abs() <= out_bound).all()
        assert (cache[write[r]].double() - ref_states[-1]).abs().max() <= state_bound[-1].max()

