"""Bfloat16 weights in the native decoder (csrc/linear/bf16_rows.c).

The row kernel on every path this machine runs (AVX512-BF16, AVX2 on widened
weights, portable C), against a float64 sum of the same bfloat16-rounded
products, on odd shapes and row ranges. Then a bfloat16 model's native steps
against an oracle that does the same arithmetic without the native code: the
torch path in float32 on the model's bfloat16 weights, with each matmul input
rounded to bfloat16 as the kernel rounds it; both fed the oracle's 64 greedy tokens (teacher
forcing), each within the bound bfloat16 input rounding allows of the float32 model on the
same weights (tests/helpers/activation_rounding.py), on the tiny models of the families
(GQA, Q/K norms, sliding windows, soft-capping, sandwich norms)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.native.config import KernelConfig
from kvserve.native import cpu_kernels, dispatch
from kvserve.model import native_decoder
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.model.quantized import ISA_CODES
from helpers.kernel_switches import env_kernels
from helpers.activation_rounding import bfloat16_half_step, max_deviation, rounding_bound
from paged_kv_helper import (VOCAB, PagedRunner, every_token_logits, run_greedy, run_teacher_forced,
                             save_tiny_model)

from helpers.native_steps import count_native_steps

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

ISAS = ["avx512", "avx2", "portable"]
NUM_NEW = 64


def _skip_unless_runs(path: str) -> None:
    if not dispatch.available("bf16", path):
        pytest.skip(f"the {path} bfloat16 path does not run here")


def _rows(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, isa: str,
          ranges: list[tuple[int, int]]) -> torch.Tensor:
    lib = cpu_kernels.load_library()
    batch, width = x.shape
    xb = torch.empty(batch, width, dtype=torch.bfloat16)
    lib.kvserve_bf16_round_rows(x.data_ptr(), x.stride(0), batch, width, xb.data_ptr())
    assert torch.equal(xb, x.to(torch.bfloat16))  # torch's rounding (to nearest even)
    y = torch.full((batch, w.shape[0]), float("nan"))
    for begin, end in ranges:
        lib.kvserve_bf16_linear_rows(xb.data_ptr(), batch, w.data_ptr(), None if bias is None else bias.data_ptr(),
                                     width, y.data_ptr(), y.stride(0), ISA_CODES[isa], begin, end)
    return y


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out,width", [(22, 96), (9, 7), (13, 33), (40, 577)])
def test_bf16_rows_match_a_float64_sum_on_every_path(isa, out, width):
    _skip_unless_runs(isa)
    generator = torch.Generator().manual_seed(out * width)
    w = torch.randn(out, width, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out, generator=generator)
    for batch in (1, 3, 4, 6, 9):
        # Strided input rows: the kernel reads x through its row stride.
        x = torch.randn(batch, width + 5, generator=generator)[:, :width]
        ref = x.to(torch.bfloat16).double() @ w.double().T + bias.double()
        y = _rows(x, w, bias, isa, [(0, min(8, out)), (min(8, out), out - 1), (out - 1, out)])
        tolerance = 1e-5 * (x.to(torch.bfloat16).double().abs() @ w.double().abs().T + 1)
        assert ((y.double() - ref).abs() <= tolerance).all(), (isa, batch)
        assert torch.equal(_rows(x, w, None, isa, [(0, out)]).double(), (y - bias).double()) or \
            torch.allclose(_rows(x, w, None, isa, [(0, out)]), y - bias, rtol=1e-6, atol=1e-5)


class _RoundedInput(torch.nn.Module):
    """Wraps a float32 projection of the oracle: its input rounded to bfloat16 first, one row
    at a time (MKL sums a row of a batched product in an order that depends on its place in
    the batch; where a sum lands next to a bfloat16 rounding boundary, that order would move
    the next matmul's input by one bfloat16 ulp)."""

    def __init__(self, linear) -> None:
        super().__init__()
        self.linear = linear
        self.shard_sizes = getattr(linear, "shard_sizes", None)

    def forward(self, x, num_draft_rows: int = 0, role: str | None = None):
        # No drafts in these runs: every row is rounded and multiplied alone anyway; `role` (the
        # step's reused output buffer) is left out: the oracle allocates its outputs.
        rows = x.to(torch.bfloat16).float().reshape(-1, x.shape[-1])
        return torch.cat([self.linear(row) for row in rows.split(1)]).view(*x.shape[:-1], -1)


def _projections(model):
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            yield parent, name, getattr(parent, name)


def _float32_with_bf16_projections(config: ModelConfig, isa: str):
    """A float32 model whose projections hold bfloat16 weights, run natively on `isa`: the
    bfloat16 kernel with float32 everywhere else (output, LM head, KV cache)."""
    model = load_model(config, kernel_config=KernelConfig(quant_isa=isa))
    for _, _, module in _projections(model):
        module.weight.data = module.weight.data.to(torch.bfloat16)
    model.use_kernels(dataclasses.replace(model.kernels, bf16_isa=isa))
    return model


def _bf16_weights(config: ModelConfig):
    """The torch path in float32 on bfloat16-rounded projection weights, inputs unrounded."""
    model = load_model(config, kernel_config=env_kernels())
    model._native = None
    for _, _, module in _projections(model):
        module.weight.data = module.weight.data.to(torch.bfloat16).float()
    return model


def _oracle(config: ModelConfig):
    """`_bf16_weights` with each projection's input rounded to bfloat16: the native call's
    arithmetic, op by op."""
    model = _bf16_weights(config)
    for parent, name, module in list(_projections(model)):
        setattr(parent, name, _RoundedInput(module))
    return model


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = save_tiny_model(family, tmp_path_factory.mktemp(family))
        return cache[family]
    return get


def _prompts(lengths: list[int], seed: int) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


@pytest.mark.parametrize("family,isa", [("llama", "avx512"), ("llama", "avx2"), ("llama", "portable"),
                                        ("qwen3", "avx512"), ("gemma2", "avx512"), ("gemma3", "avx2"),
                                        ("qwen2", "portable")])
def test_bf16_weights_match_the_oracle_over_64_steps(paths, monkeypatch, family, isa):
    """Chunks of 2 over 3 requests: prompt chunks over cached context run natively too.
    The same products summed in another order (MKL against the kernel): where a sum lands
    within that rounding of a bfloat16 boundary, the next matmul's input differs by one
    bfloat16 ulp. So both are a bfloat16 rounding of every projection input of the float32
    model on the same weights, each within the bound such rounding allows of it."""
    _skip_unless_runs(isa)
    native_steps = count_native_steps(monkeypatch)
    config = ModelConfig.from_path(paths(family))
    prompts = _prompts([5, 19, 30], seed=1)  # 30 + 64 tokens exceed the window (12) many times
    tokens, oracle = run_greedy(PagedRunner(_oracle(config), block_size=4), prompts, NUM_NEW, chunk=2)
    sequences = {r: prompts[r] + tokens[r][:-1] for r in prompts}
    prompt_lens = {r: len(p) for r, p in prompts.items()}
    ours = run_teacher_forced(PagedRunner(_float32_with_bf16_projections(config, isa), block_size=4), sequences,
                              prompt_lens, chunk=2)
    assert native_steps[0] >= NUM_NEW - 2
    plain = _bf16_weights(config)
    reference, bound = rounding_bound(plain, {module: bfloat16_half_step for _, _, module in _projections(plain)},
                                      lambda model: every_token_logits(model, sequences, prompt_lens))
    assert max_deviation(ours, reference) <= bound
    assert max_deviation({r: torch.stack(rows) for r, rows in oracle.items()}, reference) <= bound


def _float32_logits(model):
    """Logits in float32 from the bfloat16 hidden states and LM head: bfloat16 logits tie
    too often for a greedy comparison (ties go to the lower token id)."""
    model.compute_logits = lambda hidden: model._finish_logits(hidden.float() @ model.lm_head.weight.float().T)
    return model


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_model_runs_natively_close_to_the_oracle(paths, monkeypatch, family):
    """The bfloat16 model end to end (bfloat16 KV cache, output rounded to bfloat16 for the
    LM head): its steps run natively, and their logits stay within the output's rounding
    of the oracle's (with the same bfloat16 KV cache and final rounding)."""
    native_steps = count_native_steps(monkeypatch)
    config = ModelConfig.from_path(paths(family), dtype="bfloat16")
    model = load_model(config, kernel_config=env_kernels())
    assert model.kernels.native_decoder and model.kernels.bf16_isa == native_decoder.bf16_isa(env_kernels())
    prompts = _prompts([5, 19], seed=2)
    oracle = _oracle(config)
    oracle.layers.float()
    oracle.norm.float()
    inner_forward = oracle._forward  # under both forward and forward_logits

    def forward_rounded(*args):
        hidden, logits = inner_forward(*args)
        assert logits is None  # the oracle runs per op: its LM head sees the rounded states
        return hidden.to(torch.bfloat16), None
    oracle._forward = forward_rounded
    ref = run_greedy(PagedRunner(_float32_logits(oracle), block_size=4), prompts, 16, chunk=2)
    ours = run_greedy(PagedRunner(_float32_logits(model), block_size=4), prompts, 16, chunk=2, follow=ref[0])
    assert native_steps[0] >= 14
    # Both fed the oracle's tokens, both within the bound bfloat16 rounding allows of the float32
    # model on the same (bfloat16) weights, derived (tests/helpers/activation_rounding.py), not
    # tuned: that model on a float32 cache, rerun with every value the two round moved by noise
    # within half a bfloat16 ulp: each projection's input, each stored K/V element, the final
    # hidden state (the LM head's input) and the LM head's output (the oracle's bfloat16 logits).
    plain = load_model(config, kernel_config=env_kernels(packed_weights=False)).float()
    plain._native = None  # decided: the per-op path, in float32
    half_steps = {module: bfloat16_half_step for _, _, module in _projections(plain)}
    half_steps[plain.lm_head] = (bfloat16_half_step, bfloat16_half_step)

    def logits_of(model):
        rows = run_greedy(PagedRunner(model, block_size=4, kv_dtype=torch.float32), prompts, 16, chunk=2,
                          follow=ref[0])[1]
        return {r: torch.stack(logits).float() for r, logits in rows.items()}
    reference, bound = rounding_bound(plain, half_steps, logits_of, kv_half_step=bfloat16_half_step)
    for run in (ours, ref):
        assert run[0] == ref[0]
        assert max_deviation({r: torch.stack(logits).float() for r, logits in run[1].items()}, reference) <= bound
    # The bound is a small part of the logits' range: it still tells a wrong kernel apart.
    assert bound < 0.1 * min((rows.amax(-1) - rows.amin(-1)).min().item() for rows in reference.values())


def test_bf16_declined_without_a_path_and_packed_weights_keep_a_plain_copy(paths):
    config = ModelConfig.from_path(paths("llama"), dtype="bfloat16")
    off = load_model(config, kernel_config=KernelConfig(cpu_kernels=False))
    assert not off.kernels.native_decoder and native_decoder.NativeDecoder.for_model(off) is None
    model = load_model(config, kernel_config=env_kernels())
    if torch.backends.mkldnn.is_available() and model.pack_linear_weights():
        assert model.layers[0].mlp.down_proj.weight is not None  # the native decoder reads it
        assert native_decoder.NativeDecoder.for_model(model) is not None
