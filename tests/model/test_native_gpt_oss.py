"""gpt-oss in the native decoder (#28, csrc/decoder/fused_decoder.c): attention sinks, alternating
sliding-window (12) and full layers, attention biases, a biased router with a softmax over its top
k, biased clamped-SwiGLU experts, YaRN RoPE; against the per-op path of the same weights (torch
attention with sinks, moe.py), both fed the same tokens (teacher forcing). The tiny random
GptOssForCausalLM in float32 on 1, 2 and 3 threads; the GGUF llama.cpp's converter makes of its
MXFP4 checkpoint, dequantized to float32, with the MXFP4 experts held as stored, and converted
to Q8_0 (attention and head Q8_0, experts MXFP4); sequences well past the window; the sinks and
the window shown to matter; a top-k boundary tie handed back to the per-op path.
The sinks alone in the attention kernel: tests/model/test_paged_attention_kernel.py."""
from __future__ import annotations

import pytest
import torch

from kvserve.model import moe
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.native import cpu_kernels
from helpers.activation_rounding import max_deviation, quantized_half_steps, rounding_bound
from helpers.float_order import float32_reorder_bound
from helpers.kernel_switches import env_kernels
from helpers.native_steps import (count_native_steps, largest_relative_diff, native_model, per_op_model,
                                  run_chunks_of_two, steps_in_chunks_of_two)
from helpers.router_logits import RouterLogits
from paged_kv_helper import every_token_logits, save_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

# Same float32 math in another summation order (tests/helpers/float_order.py: hidden 64, expert
# width 32, at most 38 keys: no reduction over 128 terms). A gpt-oss layer chains 12 reductions:
# two norms, QKV, scores, the softmax's sum (the sink one more term of it), weighted values, O,
# the router's logits, the softmax over its top 2, each expert's gate/up and down, the weighted
# sum over the top 2. 12 < 2 x 9: each of the 2 layers counts as two dense ones.
BOUND = float32_reorder_bound(num_layers=2 * 2)
WINDOW = 12
# Prompts then teacher-forced tokens, in chunks of 2 over three requests (<= 6 tokens a step, so
# every step runs natively); the longest reaches position 37, three windows past the first.
PROMPT_LENS = [5, 13, 3]
NEW_TOKENS = 25


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ModelConfig:
    config = ModelConfig.from_path(save_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss")))
    assert config.layer_types == ["sliding", "full"] and config.sliding_window == WINDOW
    assert config.rope.rope_type == "yarn" and config.attention_sinks and config.softmax_after_topk
    return config


@pytest.fixture(scope="module")
def gguf_paths(tmp_path_factory) -> dict[str, str]:
    """llama.cpp's converter on the MXFP4 checkpoint: other tensors float32 ("f32") or Q8_0."""
    from helpers.gpt_oss_gguf import convert_to_gguf, converter_or_skip, save_mxfp4_gpt_oss
    pytest.importorskip("gguf")
    converter = converter_or_skip()
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    save_mxfp4_gpt_oss(str(root / "reference"), str(root / "mxfp4"))
    return {outtype: convert_to_gguf(str(root / "mxfp4"), str(root / f"gpt-oss-{outtype}.gguf"), converter,
                                     outtype=outtype) for outtype in ("f32", "q8_0")}


def _sequences(config: ModelConfig, seed: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    generator = torch.Generator().manual_seed(seed)
    vocab = min(config.vocab_size, 256)
    sequences = {f"r{i}": torch.randint(3, vocab, (n + NEW_TOKENS,), generator=generator).tolist()
                 for i, n in enumerate(PROMPT_LENS)}
    return sequences, {f"r{i}": n for i, n in enumerate(PROMPT_LENS)}


def _margin_ok_seed(config: ModelConfig, margin: float, edit=None, kernels=None) -> tuple[dict, dict]:
    """Sequences whose every routing decision on the per-op path is clear of a tie by more than
    `margin` (within it another float order may pick another expert: a jump no bound covers)."""
    for seed in range(20):
        sequences, prompt_lens = _sequences(config, seed)
        recorder = RouterLogits()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe, "route", recorder)
            every_token_logits(per_op_model(config, edit, kernels), sequences, prompt_lens)
        if recorder.min_margin(config.num_experts_per_tok) > margin:
            return sequences, prompt_lens
    raise AssertionError("no seed of 20 routes clear of ties")


def _dominant_routers(model) -> None:
    """Router rows 0, 1 set to 1000 u and rows 2, 3 to -1000 u (u a random row), biases zero: for
    every token the top 2 are experts 0 and 1 (u.x > 0) or 2 and 3, tied inside the top k (the
    same experts either order, each weighted 1/2), the next logit 1000 |u.x| below: routing no
    rounding can flip."""
    u = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(21))
    with torch.inference_mode():
        for layer in model.layers:
            layer.mlp.gate.weight[:2] = 1000.0 * u
            layer.mlp.gate.weight[2:4] = -1000.0 * u
            layer.mlp.gate.bias.zero_()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_gpt_oss_matches_per_op_path(tiny, monkeypatch, threads):
    """Every step native (prompt chunks over cached context and one-token steps), logits within
    the float-order bound of the per-op path's; the sinks are not zero, and the sliding layer's
    keys run out of its window many times."""
    model = load_model(tiny)
    assert all(layer.self_attn.sinks.abs().min() > 0 for layer in model.layers)
    assert model.rotary_global.attention_factor > 1.0  # YaRN's scale, in the cos/sin tables both paths read
    sequences, prompt_lens = _margin_ok_seed(tiny, 2 * BOUND)
    assert max(map(len, sequences.values())) > 3 * WINDOW
    per_op = run_chunks_of_two(per_op_model(tiny), sequences, prompt_lens)
    native_steps = count_native_steps(monkeypatch)
    native = native_model(tiny, threads)
    ours = run_chunks_of_two(native, sequences, prompt_lens)
    assert native_steps[0] == steps_in_chunks_of_two(sequences, prompt_lens) and native._native.num_routing_ties == 0
    assert largest_relative_diff(ours, per_op) <= BOUND


@pytest.mark.parametrize("drop", ["sinks", "window"])
def test_sinks_and_window_matter_on_these_sequences(tiny, drop):
    """The native call without layer 0's sinks, or without its window, moves the logits by far
    more than the bound: the comparison above tells them apart."""
    sequences, prompt_lens = _margin_ok_seed(tiny, 2 * BOUND)
    reference = run_chunks_of_two(native_model(tiny), sequences, prompt_lens)
    model = native_model(tiny)
    layer = model._native._layers[0]
    if drop == "sinks":
        layer.sinks = None
    else:
        assert layer.window == WINDOW
        layer.window = 0
    assert largest_relative_diff(run_chunks_of_two(model, sequences, prompt_lens), reference) > 100 * BOUND


def test_top_k_boundary_tie_goes_to_the_per_op_path(tiny, monkeypatch):
    """A zero router (weights and bias) ties every expert for every token: torch.topk's order
    picks, which the native call does not reproduce, so it hands every step back and the
    logits are the per-op path's bits."""
    def zero_router(model):
        with torch.inference_mode():
            for layer in model.layers:
                layer.mlp.gate.weight.zero_()
                layer.mlp.gate.bias.zero_()

    sequences, prompt_lens = _sequences(tiny, 0)
    per_op = run_chunks_of_two(per_op_model(tiny, zero_router), sequences, prompt_lens)
    native_steps = count_native_steps(monkeypatch)
    model = native_model(tiny, edit=zero_router)
    ours = run_chunks_of_two(model, sequences, prompt_lens)
    assert native_steps[0] == 0 and model._native.num_routing_ties == steps_in_chunks_of_two(sequences, prompt_lens)
    assert all(torch.equal(ours[r], per_op[r]) for r in per_op)


def _gguf_config(gguf_paths, source: str) -> ModelConfig:
    """"dequantized" / "q8_0 dequantized": the f32 / q8_0 file in float32; "mxfp4" / "q8_0": the
    f32 / q8_0 file as stored."""
    path = gguf_paths["q8_0" if source.startswith("q8_0") else "f32"]
    if source.endswith("dequantized"):
        return ModelConfig.from_path(path, quantization="none", dtype="float32")
    return ModelConfig.from_path(path)


@pytest.mark.parametrize("source", ["dequantized", "mxfp4", "q8_0"])
def test_gguf_native_matches_per_op_path(gguf_paths, monkeypatch, source):
    """The converter's GGUF, dequantized to float32: within the float-order bound. With its MXFP4
    experts held as stored, or (q8_0) its Q8_0 attention and head repacked to round activations to
    int16 (at int8 this random model's logits move by a third of their scale; the MXFP4 experts,
    which have no int16 kernel, are then float32), both paths round the same rows with the same
    kernels, but another float order upstream may put a value on the
    other side of a rounding boundary, a step no float-order bound covers: within the
    activation-rounding bound (tests/helpers/activation_rounding.py: every quantized matmul's
    input moved by up to half a step moves the logits more than a few inputs moved by a whole
    one), on routers no such move can flip (`_dominant_routers`: this random router's near-ties
    sit within int8 rounding's reach in nearly every sequence). 1, 2 and 3 threads: the same bits."""
    config = _gguf_config(gguf_paths, source)
    edit = None if source == "dequantized" else _dominant_routers
    kernels = env_kernels(quant_act_bits=16) if source == "q8_0" else None
    model = native_model(config, edit=edit, kernels=kernels)
    stored = {part.type_name for layer in model.layers for expert in layer.mlp.experts
              for part in getattr(expert.gate_up_proj.quant_weight, "parts", [expert.gate_up_proj.quant_weight])
              if part is not None}
    assert stored == ({"MXFP4"} if source == "mxfp4" else set())  # q8_0: int16 widens MXFP4 to float32
    assert (model.layers[0].self_attn.qkv_proj.quant_weight is not None) == (source == "q8_0")
    if source == "dequantized":
        sequences, prompt_lens = _margin_ok_seed(config, 2 * BOUND)
        bound = BOUND  # relative to each row's scale
    else:
        plain = per_op_model(_gguf_config(gguf_paths, "dequantized" if source == "mxfp4" else "q8_0 dequantized"), edit)
        sequences, prompt_lens = _sequences(config, 0)
        reference, rounding = rounding_bound(plain, quantized_half_steps(plain, model),
                                             lambda m: every_token_logits(m, sequences, prompt_lens))
        scale = max(ref.abs().max().item() for ref in reference.values())
        bound = BOUND + rounding / scale  # relative to the logits' scale
        assert bound < 0.05  # still tells wrong weights apart
        sequences, prompt_lens = _margin_ok_seed(config, 2 * bound, edit, kernels)
    per_op = run_chunks_of_two(per_op_model(config, edit, kernels), sequences, prompt_lens)
    native_steps = count_native_steps(monkeypatch)
    results = [run_chunks_of_two(native_model(config, threads, edit, kernels), sequences, prompt_lens) for threads in (1, 2, 3)]
    assert native_steps[0] == 3 * steps_in_chunks_of_two(sequences, prompt_lens)
    if source == "dequantized":
        assert largest_relative_diff(results[0], per_op) <= bound
    else:
        scale = max(ref.abs().max().item() for ref in per_op.values())
        assert max_deviation(results[0], per_op) <= bound * scale
    for other in results[1:]:
        assert all(torch.equal(other[r], results[0][r]) for r in results[0])


def test_whole_experts_per_thread_give_the_same_bits(tiny):
    """gpt-oss's biased, clamped-SwiGLU experts split over the threads whole or by rows
    (NativeDecoder.moe_split), on 1, 2 and 3 threads: the same bits."""
    sequences, prompt_lens = _sequences(tiny, 0)
    results = []
    for split in ("rows", "experts"):
        for threads in (1, 2, 3):
            model = native_model(tiny, threads)
            model._native.moe_split = split
            results.append(run_chunks_of_two(model, sequences, prompt_lens))
    for other in results[1:]:
        assert all(torch.equal(other[r], results[0][r]) for r in results[0])
