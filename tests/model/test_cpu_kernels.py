"""The native CPU kernels (kvserve/native/cpu_kernels.py) against the torch ops they
replace, and the decoder with the kernels off against the decoder with them on."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve.native.config import CPU_KERNELS_ENV, SMALL_BATCH_MATMUL_ENV, KernelConfig
from kvserve.native import cpu_kernels
from kvserve.model.config import ModelConfig
from kvserve.model.kernels import AttentionShape, choose_model_kernels
from kvserve.model.layers import RMSNorm
from kvserve.model.loader import load_model
from kvserve.model.parallel import ColumnParallelLinear, TPContext, cpu_weight_packing_supported
from helpers.kernel_switches import env_kernels
from paged_kv_helper import PagedRunner, run_greedy, save_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None,
                                reason="the native CPU kernels could not be built (no C compiler?)")
DTYPES = [torch.float32, torch.bfloat16]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # bfloat16: at most one rounding step apart (the float32 sums run in another order).
    tolerance = 1e-5 if actual.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adds_one", [False, True])
def test_rms_norm_and_fused_residual_add_match_torch(dtype, adds_one):
    norm = RMSNorm(96, 1e-6, adds_one)
    norm.weight.data = _rand(96, dtype=torch.float32, seed=1).to(dtype)
    norm = norm.to(dtype)
    norm.native = True
    x, residual = _rand(7, 96, dtype=dtype, seed=2), _rand(7, 96, dtype=dtype, seed=3)
    _close(norm(x), norm._torch_norm(x))
    expected_sum = residual + x
    expected = norm._torch_norm(expected_sum)
    out, new_residual = norm.add_and_norm(x, residual)
    assert new_residual is residual  # the sum is stored in place
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=0)
    _close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = _rand(5, 2 * 1100, dtype=dtype) * 4  # wider than the kernel's 1024-element chunk
    gate, up = gate_up.chunk(2, dim=-1)
    _close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view_matches_torch(dtype):
    qkv = _rand(6, 5, 16, dtype=dtype)
    q = qkv[:, :3]  # a view, as the fused QKV projection hands it over
    angles = torch.arange(6.0)[:, None] * torch.linspace(0.1, 1.0, 8)[None, :]
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)[:, None]
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)[:, None]
    rotated = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
    expected = q * cos + rotated * sin
    untouched = qkv[:, 3:].clone()
    cpu_kernels.rotary_(q, cos, sin)
    _close(q, expected)
    torch.testing.assert_close(qkv[:, 3:], untouched, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_without_kernels_matches_decoder_with_them(tmp_path, monkeypatch, dtype):
    """The torch path (CUDA, KVSERVE_CPU_KERNELS=0) and the kernel path agree on greedy tokens."""
    config = ModelConfig.from_path(save_tiny_model("llama", tmp_path), dtype=dtype)
    prompts = {"a": list(range(3, 40)), "b": list(range(50, 61)), "c": [7, 8]}
    native = load_model(config, kernel_config=env_kernels())
    assert native.kernels.attention.name == "cpu_native" and native.kernels.native_ops
    with_kernels = run_greedy(PagedRunner(native, block_size=4), prompts, 5, chunk=64)
    portable = load_model(config, kernel_config=KernelConfig(cpu_kernels=False))
    assert portable.kernels.attention.name == "torch" and not portable.kernels.native_ops
    without = run_greedy(PagedRunner(portable, block_size=4), prompts, 5, chunk=64)
    assert with_kernels[0] == without[0]
    for req_id in prompts:
        for ours, ref in zip(with_kernels[1][req_id], without[1][req_id]):
            # float32: the rounding of another summation order; bfloat16: ~3 significant digits.
            atol = 1e-4 if dtype == "float32" else 0.05 * ref.abs().max().item()
            torch.testing.assert_close(ours, ref, atol=atol, rtol=0)


SHAPE = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_kernels_switched_off_by_environment(value):
    config = KernelConfig.from_env({CPU_KERNELS_ENV: value})
    assert not config.cpu_kernels
    kernels = choose_model_kernels(config, "cpu", torch.float32, SHAPE)
    assert kernels.attention.name == "torch" and not kernels.native_ops and not kernels.small_batch_matmul
    on = choose_model_kernels(KernelConfig.from_env({}), "cpu", torch.float32, SHAPE)
    assert on.attention.name == "cpu_native" and on.native_ops
    # float16 has no kernels; the choice falls back as a whole.
    assert choose_model_kernels(KernelConfig(), "cpu", torch.float16, SHAPE).attention.name == "torch"


def test_store_kv_writes_the_listed_tokens_where_index_copy_would():
    cache = torch.zeros(2, 2, 6, 4, 8, dtype=torch.bfloat16)
    qkv = _rand(5, 6, 8, dtype=torch.bfloat16)
    k, v = qkv[:, 2:4], qkv[:, 4:6]  # strided views, as the projection hands them over
    slots, tokens = torch.tensor([3, 17, 9]), torch.tensor([4, 0, 2])
    cpu_kernels.store_kv(k, v, cache, slots, tokens)
    expected = torch.zeros_like(cache).view(2, 2, -1, 8)
    expected[0][:, slots] = k[tokens].transpose(0, 1)
    expected[1][:, slots] = v[tokens].transpose(0, 1)
    torch.testing.assert_close(cache.view(2, 2, -1, 8), expected, atol=0, rtol=0)


def test_huge_page_buffer_is_zeroed_and_aligned():
    nbytes = 9 * (2 << 20) + 123
    buffer = cpu_kernels.zeros_on_huge_pages(nbytes)
    assert buffer.numel() == nbytes and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % (2 << 20) == 0 or not sys.platform.startswith("linux")
    assert int(buffer.count_nonzero()) == 0


def _needs_small_linear(dtype: torch.dtype) -> None:
    if not cpu_kernels.small_linear_supported(dtype):
        pytest.skip(f"the small-batch matmul kernel is not built for {dtype} on this CPU")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("out_features, in_features", [(13, 77), (64, 576), (962, 1536)])
def test_small_linear_matches_a_float64_matmul(dtype, rows, out_features, in_features):
    """Row and width tails (out % 4, in % 32), strided rows of x, a bias; the float64
    product rounded once to the dtype is the oracle (bfloat16: one rounding step)."""
    _needs_small_linear(dtype)
    weight = _rand(out_features, in_features, dtype=dtype, seed=1)
    bias = _rand(out_features, dtype=dtype, seed=2)
    wide = _rand(rows, in_features + 40, dtype=dtype, seed=3)
    x = wide[:, 5:5 + in_features]  # rows in_features + 40 apart
    expected = (x.double() @ weight.double().T + bias.double()).to(dtype)
    actual = cpu_kernels.small_linear(x, weight, bias)
    assert actual.shape == (rows, out_features) and actual.dtype == dtype
    scale = expected.float().abs().max().item()
    tolerance = 1e-5 * scale if dtype == torch.float32 else 2 ** -7 * scale
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=0)
    torch.testing.assert_close(cpu_kernels.small_linear(x, weight), (x.double() @ weight.double().T).to(dtype),
                               atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_runs_small_batches_through_the_kernel(monkeypatch, dtype):
    """Up to SMALL_LINEAR_MAX_ROWS rows take the kernel over the plain weight, more rows
    oneDNN's packed weight; both give the plain F.linear result."""
    _needs_small_linear(dtype)
    if not cpu_weight_packing_supported(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} weights here")
    layer = ColumnParallelLinear(96, [40, 24], bias=False, tp=TPContext()).to(dtype)
    layer.weight.data = _rand(64, 96, dtype=dtype, seed=4)
    plain = layer.weight.detach().clone()
    layer.pack_weight(keep_plain=True)
    calls = []
    real = cpu_kernels.small_linear
    monkeypatch.setattr(cpu_kernels, "small_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, cpu_kernels.SMALL_LINEAR_MAX_ROWS, cpu_kernels.SMALL_LINEAR_MAX_ROWS + 1, 33):
        x = _rand(rows, 96, dtype=dtype, seed=rows)
        _close(layer(x), F.linear(x, plain))
    assert calls == [1, cpu_kernels.SMALL_LINEAR_MAX_ROWS]


def test_small_batch_matmul_switched_off_by_environment():
    off = KernelConfig.from_env({SMALL_BATCH_MATMUL_ENV: "0"})
    assert not choose_model_kernels(off, "cpu", torch.float32, SHAPE).small_batch_matmul
    on = KernelConfig.from_env({SMALL_BATCH_MATMUL_ENV: "1"})
    assert (choose_model_kernels(on, "cpu", torch.float32, SHAPE).small_batch_matmul
            == cpu_kernels.small_linear_supported(torch.float32))
