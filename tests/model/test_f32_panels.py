"""Float32 weights packed into panels (csrc/linear/f32_gemm.c): the kernel against a float64
reference on every path this CPU runs (row and panel tails, odd widths, strided rows,
bias, threads); the native decoder over panel-packed models on steps of 9 to 48 tokens
and 40 sequences, against the per-op path of the same model and against the plain
(unpacked) weights, on the tiny models of every family; and the weights held once."""
from __future__ import annotations

import pytest
import torch

from kvserve.native import cpu_kernels, dispatch
from kvserve.native import isa as isa_table
from kvserve.model import native_decoder, quantized
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.kernel_switches import env_kernels
from helpers.float_order import TINY_MODEL_REORDER_BOUND
from helpers.native_steps import record_step_sizes
from paged_kv_helper import PagedRunner, assert_same_greedy, random_prompts, run_greedy, tiny_configs

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

PATHS = [path for path in isa_table.ISAS if dispatch.available("f32_gemm", path)]
FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]
# The per-op path of the same packed model runs the same kernel on the same rows: only
# the element-wise steps may round differently. Against plain weights (MKL's sums in
# another order) the bound is the same: float32 summation order (tests/helpers/float_order.py).
MAX_LOGIT_DIFF = TINY_MODEL_REORDER_BOUND


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (15, 7), (16, 64), (17, 33), (50, 130), (100, 576)])
@pytest.mark.parametrize("batch", [1, 5, 8, 9, 17, 40])
def test_kernel_matches_float64(isa, out_features, in_features, batch):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features + batch)
    w = torch.randn(out_features, in_features, generator=generator)
    wide = torch.randn(batch, in_features + 11, generator=generator)
    x = wide[:, 3:3 + in_features]  # rows in_features + 11 floats apart
    bias = torch.randn(out_features, generator=generator) if batch % 2 else None
    panels = cpu_kernels.pack_f32_panels(w)
    assert panels.shape == (-(-out_features // 16), in_features, 16)
    y = cpu_kernels.f32_gemm(x, panels, out_features, quantized.ISA_CODES[isa], bias)
    ref = _reference(x, w, bias)
    scale = (x.double().abs() @ w.double().abs().T).max().item() + 1.0
    assert y.shape == (batch, out_features) and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() <= 1e-5 * scale


def test_kernel_threads_and_leading_dims():
    """Many rows (the per-op prefill): the threads split the panels; [..., in] inputs."""
    generator = torch.Generator().manual_seed(7)
    w, x = torch.randn(200, 96, generator=generator), torch.randn(3, 70, 96, generator=generator)
    panels = cpu_kernels.pack_f32_panels(w)
    for isa in PATHS:
        y = cpu_kernels.f32_gemm(x, panels, 200, quantized.ISA_CODES[isa])
        assert y.shape == (3, 70, 200)
        assert (y.double() - _reference(x, w, None)).abs().max().item() <= 1e-5 * 96


@pytest.mark.parametrize("isa", PATHS)
def test_kernel_takes_no_rows(isa):
    """A step that wants no logits multiplies zero rows: an empty result, nothing else."""
    panels = cpu_kernels.pack_f32_panels(torch.randn(40, 24))
    y = cpu_kernels.f32_gemm(torch.zeros(0, 24), panels, 40, quantized.ISA_CODES[isa])
    assert y.shape == (0, 40)


def test_pack_layout_and_bad_input():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = cpu_kernels.pack_f32_panels(w)
    assert torch.equal(panels[0], w[:16].T) and torch.equal(panels[1, :, :4], w[16:].T)
    assert not panels[1, :, 4:].any()  # rows past `out`: zeros
    with pytest.raises(cpu_kernels.KernelArgumentError):
        cpu_kernels.pack_f32_panels(w.double())
    with pytest.raises(cpu_kernels.KernelArgumentError):
        cpu_kernels.f32_gemm(torch.zeros(2, 4), panels, 20, quantized.ISA_CODES["portable"])


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return tiny_configs(tmp_path_factory)


@pytest.fixture
def step_sizes(monkeypatch):
    """The token count of every step the native decoder ran (did not decline)."""
    return record_step_sizes(monkeypatch)


def _model(config: ModelConfig, mode: str, isa: str | None = None, threads: int | None = None):
    """mode "native": panels, native decoder; "per-op": panels, torch path; "plain": no packing."""
    model = load_model(config, kernel_config=env_kernels(**({"quant_isa": isa} if isa else {})))
    if mode != "plain":
        assert model.pack_linear_weights()
    if mode != "native":
        model._native = None  # decided: the per-op path
    elif threads:
        model._native = native_decoder.NativeDecoder.for_model(model)
        model._native.num_threads = threads
    return model


def _assert_same(ours, ref) -> None:
    """`ours` ran following `ref`'s greedy tokens (teacher forcing: a near-tie between two
    float orders is no failure)."""
    assert_same_greedy(ours, ref, MAX_LOGIT_DIFF)


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_steps_match_per_op_and_plain_weights(configs, step_sizes, family):
    """12 requests, prompt chunks of 4: steps of up to 48 tokens mixing prefill chunks and
    decodes, then 12-token decode steps; two threads share out panels and attention."""
    config, prompts = configs(family), random_prompts(12, seed=1)
    ref = run_greedy(PagedRunner(_model(config, "per-op"), block_size=4), prompts, 20, chunk=4)
    ours = run_greedy(PagedRunner(_model(config, "native", threads=2), block_size=4), prompts, 20, chunk=4, follow=ref[0])
    assert max(step_sizes) > 16 and sum(size > 8 for size in step_sizes) >= 16
    _assert_same(ours, ref)
    plain = run_greedy(PagedRunner(_model(config, "plain"), block_size=4), prompts, 20, chunk=4, follow=ref[0])
    _assert_same(ours, plain)


@pytest.mark.parametrize("isa", PATHS)
def test_every_path_over_64_steps(configs, step_sizes, isa):
    config, prompts = configs("qwen2"), random_prompts(10, seed=4)  # qwen2: QKV bias
    ref = run_greedy(PagedRunner(_model(config, "plain"), block_size=4), prompts, 64, chunk=5)
    ours = run_greedy(PagedRunner(_model(config, "native", isa=isa), block_size=4), prompts, 64, chunk=5, follow=ref[0])
    assert sum(size > 8 for size in step_sizes) >= 60
    _assert_same(ours, ref)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_forty_sequences_decoding_together(configs, step_sizes, family):
    config, prompts = configs(family), random_prompts(40, seed=2)
    ref = run_greedy(PagedRunner(_model(config, "plain"), block_size=4, num_blocks=2048), prompts, 12, chunk=1)
    runner = PagedRunner(_model(config, "native"), block_size=4, num_blocks=2048)  # gemma2: two groups' blocks
    ours = run_greedy(runner, prompts, 12, chunk=1, follow=ref[0])
    assert step_sizes.count(40) >= 14 and max(step_sizes) == 40
    _assert_same(ours, ref)


def test_weights_held_once_and_long_steps_per_op(configs, step_sizes):
    config = configs("llama")
    model = _model(config, "native")
    linears = [model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj, model.lm_head]
    assert all(m.weight is None and m.packed_weight is None and m.panel_weight is not None for m in linears)
    assert model.embed_tokens.weight is not None  # the embedding keeps its table (tied or not)
    assert native_decoder.NativeDecoder.for_model(model).max_tokens == native_decoder.MAX_TOKENS
    prompts = {"long": random_prompts(1, seed=3)["r0"] * 10}  # > 128 tokens in one chunk: the per-op path
    ref = run_greedy(PagedRunner(_model(config, "plain"), block_size=4), prompts, 2, chunk=1000)
    ours = run_greedy(PagedRunner(model, block_size=4), prompts, 2, chunk=1000, follow=ref[0])
    assert step_sizes == [1]
    _assert_same(ours, ref)
    onednn = load_model(config, kernel_config=env_kernels())
    if torch.backends.mkldnn.is_available():  # the oneDNN layout stays on request
        assert onednn.pack_linear_weights(panels=False) and onednn.layers[0].self_attn.qkv_proj.panel_weight is None
    off = load_model(config, kernel_config=env_kernels(packed_weights=False))
    assert off.kernels.f32_gemm_isa is None
