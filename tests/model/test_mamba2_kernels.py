"""Mamba-2 kernels (kvserve/model/linear_attention/mamba2.py) against a float64 token-by-token
loop written from the recurrence: the decode step, the chunked prefill with snapshots at
given offsets, and a prompt resumed from a snapshot.

The bound. Every output is a sum of products of the float32 inputs, computed in float32 in
some order; an expression tree of depth m with nonnegative weights errs by at most
gamma_m = m u / (1 - m u) (u = 2**-24) times the same tree evaluated on the terms' magnitudes
(Higham, 3.1-3.5). Here that magnitude is the float64 loop run on |x|, |B|, |C|, |D| and the
conv's |w| |input| + |b| (the silu after it is 1.1-Lipschitz, so its input's error passes
through scaled by at most 1.1). The depth: the conv (K taps + bias + silu: K + 3) enters
three factors (x, B, C: 3 (K + 3)); the state's dot product with C (N terms); the sums
within an SSD chunk (Q terms) and the chain of chunk states (L / Q); softplus, exp and the
dt products (8 roundings). An SSD decay is exp of a sum of up to Q log-decays |a| <= a_max,
which float32 sums to within Q u of the sum of their magnitudes, so the exp errs by up to
Q^2 a_max u relative: Q^2 a_max more levels. That is m = 3 (K + 3) + N + Q + L / Q + 8 +
Q^2 a_max."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.model.linear_attention.mamba2 import SSD_CHUNK, Mamba2Params, Mamba2Shape, decode_step, prefill

U = 2.0 ** -24
SHAPE = Mamba2Shape(num_heads=4, head_dim=8, state_size=16, n_groups=2, conv_kernel=4)


def _params(shape: Mamba2Shape, seed: int) -> Mamba2Params:
    g = torch.Generator().manual_seed(seed)
    return Mamba2Params(conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel, generator=g) * 0.5,
                        conv_bias=torch.randn(shape.conv_dim, generator=g) * 0.1,
                        dt_bias=torch.randn(shape.num_heads, generator=g) * 0.5 - 1.0,
                        A=-torch.rand(shape.num_heads, generator=g) * 0.5 - 0.05,
                        D=torch.randn(shape.num_heads, generator=g))


def _inputs(shape: Mamba2Shape, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(length, shape.conv_dim, generator=g), torch.randn(length, shape.num_heads, generator=g),
            torch.randn(shape.conv_kernel - 1, shape.conv_dim, generator=g),
            torch.randn(shape.num_heads, shape.head_dim, shape.state_size, generator=g) * 0.3)


def _reference(shape: Mamba2Shape, params: Mamba2Params, xbc, dt_raw, conv_state, ssm_state, magnitudes=False):
    """float64 token-by-token loop: (y [L, H*P], conv states and SSM states after each token).
    With `magnitudes`: the same on the terms' magnitudes (the bound's tree, see above)."""
    f = (lambda t: t.double().abs()) if magnitudes else (lambda t: t.double())
    w, bias, A, D = f(params.conv_weight), f(params.conv_bias), params.A.double(), f(params.D)
    dt_all = torch.nn.functional.softplus(dt_raw.double() + params.dt_bias.double()).clamp(params.dt_min,
                                                                                         params.dt_max)
    history = [row for row in f(conv_state)]
    state = f(ssm_state).clone()
    per_group = shape.num_heads // shape.n_groups
    gn = shape.n_groups * shape.state_size
    ys, convs, states = [], [], []
    for t in range(len(xbc)):
        history.append(f(xbc[t]))
        window = torch.stack(history[-shape.conv_kernel:])
        pre = sum(window[k] * w[:, k] for k in range(shape.conv_kernel)) + bias
        conv = 1.1 * pre if magnitudes else pre * torch.sigmoid(pre)
        x = conv[:shape.inner_size].reshape(shape.num_heads, shape.head_dim)
        b = conv[shape.inner_size:shape.inner_size + gn].reshape(shape.n_groups, shape.state_size)
        c = conv[shape.inner_size + gn:].reshape(shape.n_groups, shape.state_size)
        y = torch.empty(shape.num_heads, shape.head_dim, dtype=torch.float64)
        for h in range(shape.num_heads):
            dt = dt_all[t, h]
            state[h] = torch.exp(dt * A[h]) * state[h] + dt * torch.outer(x[h], b[h // per_group])
            y[h] = state[h] @ c[h // per_group] + D[h] * x[h]
        ys.append(y.flatten())
        convs.append(torch.stack(history[-(shape.conv_kernel - 1):]))
        states.append(state.clone())
    return torch.stack(ys), torch.stack(convs), torch.stack(states)


def _depth(shape: Mamba2Shape, params: Mamba2Params, dt_raw, length: int, chunk: int) -> int:
    a_max = (torch.nn.functional.softplus(dt_raw + params.dt_bias).clamp(params.dt_min, params.dt_max)
             * params.A.abs()).max().item()
    return 3 * (shape.conv_kernel + 3) + shape.state_size + chunk + math.ceil(length / chunk) + 8 \
        + math.ceil(chunk * chunk * a_max)


def _gamma(m: int) -> float:
    return m * U / (1 - m * U)


@pytest.mark.parametrize("dt_range", [(0.0, float("inf")), (0.2, 0.6)])
def test_prefill_with_snapshots_matches_float64_loop(dt_range):
    """150 tokens (three SSD chunks, a partial last one) from nonzero states, snapshots at
    block boundaries 16, 32, 48 and 96 and at the end; with the time step unclamped and clamped
    to a range that cuts both ends."""
    params = _params(SHAPE, 0)
    params.dt_min, params.dt_max = dt_range
    xbc, dt_raw, conv0, ssm0 = _inputs(SHAPE, 150, 1)
    write_after = [16, 32, 48, 96, 150]
    y, convs, ssms = prefill(SHAPE, params, xbc, dt_raw, conv0, ssm0, write_after)
    ref_y, ref_conv, ref_ssm = _reference(SHAPE, params, xbc, dt_raw, conv0, ssm0)
    mag_y, _, mag_ssm = _reference(SHAPE, params, xbc, dt_raw, conv0, ssm0, magnitudes=True)
    gamma = _gamma(_depth(SHAPE, params, dt_raw, 150, SSD_CHUNK))
    assert ((y.double() - ref_y).abs() <= gamma * mag_y).all()
    index = torch.tensor(write_after) - 1
    assert ((ssms.double() - ref_ssm[index]).abs() <= gamma * mag_ssm[index]).all()
    # The conv state is a copy of inputs: exact.
    assert torch.equal(convs.double(), ref_conv[index])
    # The bound tells a wrong result apart: under 1% of the outputs' scale, where a wrong decay,
    # group or skip moves outputs by their own size.
    assert gamma * mag_y.max() < 1e-2 * ref_y.abs().max()


def test_decode_steps_match_float64_loop():
    """Three requests stepped one token at a time for 20 tokens, each from its own states."""
    params = _params(SHAPE, 2)
    runs = [_inputs(SHAPE, 20, seed) for seed in (3, 4, 5)]
    conv = torch.stack([run[2] for run in runs])
    ssm = torch.stack([run[3] for run in runs])
    ys = []
    for t in range(20):
        y, conv, ssm = decode_step(SHAPE, params, torch.stack([run[0][t] for run in runs]),
                                   torch.stack([run[1][t] for run in runs]), conv, ssm)
        ys.append(y)
    for i, (xbc, dt_raw, conv0, ssm0) in enumerate(runs):
        ref_y, ref_conv, ref_ssm = _reference(SHAPE, params, xbc, dt_raw, conv0, ssm0)
        mag_y, _, mag_ssm = _reference(SHAPE, params, xbc, dt_raw, conv0, ssm0, magnitudes=True)
        # One token a step: a chunk of 1, 20 chained states.
        gamma = _gamma(_depth(SHAPE, params, dt_raw, 20, 1))
        assert ((torch.stack([y[i] for y in ys]).double() - ref_y).abs() <= gamma * mag_y).all()
        assert ((ssm[i].double() - ref_ssm[-1]).abs() <= gamma * mag_ssm[-1]).all()
        assert torch.equal(conv[i].double(), ref_conv[-1])


@pytest.mark.parametrize("split", [1, 3, 64, 70])
def test_prompt_resumed_from_a_snapshot_matches_float64_loop(split):
    """A prompt computed in two pieces, the second from the first's end states (chunked
    prefill, a prefix hit), stays within the bound of the whole prompt's float64 loop."""
    params = _params(SHAPE, 6)
    xbc, dt_raw, conv0, ssm0 = _inputs(SHAPE, 90, 7)
    y1, conv1, ssm1 = prefill(SHAPE, params, xbc[:split], dt_raw[:split], conv0, ssm0, [split])
    y2, _, ssm2 = prefill(SHAPE, params, xbc[split:], dt_raw[split:], conv1[0], ssm1[0], [90 - split])
    ref_y, _, ref_ssm = _reference(SHAPE, params, xbc, dt_raw, conv0, ssm0)
    mag_y, _, mag_ssm = _reference(SHAPE, params, xbc, dt_raw, conv0, ssm0, magnitudes=True)
    # Two chains of chunks, each at most the whole one's depth, one after the other.
    gamma = 2 * _gamma(_depth(SHAPE, params, dt_raw, 90, SSD_CHUNK))
    assert ((torch.cat([y1, y2]).double() - ref_y).abs() <= gamma * mag_y).all()
    assert ((ssm2[0].double() - ref_ssm[-1]).abs() <= gamma * mag_ssm[-1]).all()


def test_prefill_rejects_snapshot_offsets_out_of_order():
    xbc, dt_raw, conv0, ssm0 = _inputs(SHAPE, 8, 8)
    with pytest.raises(ValueError, match="write_after"):
        prefill(SHAPE, _params(SHAPE, 0), xbc, dt_raw, conv0, ssm0, [5, 3])
    with pytest.raises(ValueError, match="write_after"):
        prefill(SHAPE, _params(SHAPE, 0), xbc, dt_raw, conv0, ssm0, [9])


NATIVE_PATHS = [isa for isa in ("portable", "avx2", "avx512")]


@pytest.mark.parametrize("dt_range", [(0.0, float("inf")), (0.2, 0.6)])
@pytest.mark.parametrize("isa", NATIVE_PATHS)
def test_native_decode_step_matches_torch_reference(isa, dt_range):
    """The C step (csrc/ssm/mamba2_step.c) on each path this machine runs, against the torch
    step: 12 tokens for 3 requests, from a zero state (slot -1), a state in another slot, and
    a state updated in place; outputs and states within twice the step's bound (each is within
    the bound of the float64 loop). A state size of 20 leaves a tail after 16 and 8 lanes."""
    from kvserve.native import cpu_kernels, dispatch
    if cpu_kernels.load_library() is None or not dispatch.available("mamba2", isa):
        pytest.skip(f"no {isa} path here")
    shape = Mamba2Shape(num_heads=6, head_dim=4, state_size=20, n_groups=3, conv_kernel=4)
    params = _params(shape, 9)
    params.dt_min, params.dt_max = dt_range
    runs = [_inputs(shape, 12, seed) for seed in (10, 11, 12)]
    conv_cache = torch.zeros(8, *shape.state_shapes[0])
    ssm_cache = torch.zeros(8, *shape.state_shapes[1])
    conv_cache[2], ssm_cache[2] = runs[1][2], runs[1][3]
    conv_cache[5], ssm_cache[5] = runs[2][2], runs[2][3]
    read, write = torch.tensor([-1, 2, 5]), torch.tensor([1, 3, 5])
    conv = torch.stack([torch.zeros_like(runs[0][2]), runs[1][2], runs[2][2]])
    ssm = torch.stack([torch.zeros_like(runs[0][3]), runs[1][3], runs[2][3]])
    weight = params.conv_weight.contiguous()
    for t in range(12):
        xbc = torch.stack([run[0][t] for run in runs])
        dt_raw = torch.stack([run[1][t] for run in runs])
        y_native = cpu_kernels.mamba2_decode_step(xbc, dt_raw, conv_cache, ssm_cache, read, write, weight,
                                                  params.conv_bias, params.dt_bias, params.A, params.D,
                                                  (params.dt_min, params.dt_max), shape.n_groups, isa=isa)
        y, conv, ssm = decode_step(shape, params, xbc, dt_raw, conv, ssm)
        read = write
        gamma = 2 * _gamma(_depth(shape, params, dt_raw, t + 1, 1))
        # Magnitudes: the float64 loop on |terms| over the tokens so far, for each request.
        for i, (xs, dts, conv0, ssm0) in enumerate(runs):
            mag_y, _, mag_ssm = _reference(shape, params, xs[:t + 1], dts[:t + 1],
                                           conv0 if i else torch.zeros_like(conv0),
                                           ssm0 if i else torch.zeros_like(ssm0), magnitudes=True)
            assert ((y_native[i] - y[i]).abs().double() <= gamma * mag_y[-1]).all()
            assert ((ssm_cache[write[i]] - ssm[i]).abs().double() <= gamma * mag_ssm[-1]).all()
            assert torch.equal(conv_cache[write[i]], conv[i])


def test_native_decode_step_gives_the_same_bits_on_any_thread_count():
    """A step whose states are large enough to split over threads (3 requests x 16 heads x 32 x
    64) gives bit for bit what one thread gives: each (request, head) is one thread's whole."""
    from kvserve.native import cpu_kernels
    if cpu_kernels.load_library() is None:
        pytest.skip("no native kernels")
    shape = Mamba2Shape(num_heads=16, head_dim=32, state_size=64, n_groups=2, conv_kernel=4)
    params = _params(shape, 13)
    g = torch.Generator().manual_seed(14)
    xbc, dt_raw = torch.randn(3, shape.conv_dim, generator=g), torch.randn(3, shape.num_heads, generator=g)
    caches = (torch.randn(4, *shape.state_shapes[0], generator=g), torch.randn(4, *shape.state_shapes[1], generator=g))
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            conv, ssm = (cache.clone() for cache in caches)
            y = cpu_kernels.mamba2_decode_step(xbc, dt_raw, conv, ssm, torch.tensor([1, -1, 3]),
                                               torch.tensor([1, 2, 0]), params.conv_weight.contiguous(),
                                               params.conv_bias, params.dt_bias, params.A, params.D,
                                               (params.dt_min, params.dt_max), shape.n_groups)
            results.append((y, conv, ssm))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)
