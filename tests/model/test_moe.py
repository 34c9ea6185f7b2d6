"""Mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) on paged KV against transformers
in float32; routing edge cases on one MoE block against transformers' block; GGUF experts
held quantized as stored against the same file dequantized, under teacher forcing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.model.moe import SparseMoeBlock, route
from helpers.native_steps import count_native_steps
from helpers.tiny_models import MOE_FAMILIES, min_router_margin
from paged_kv_helper import (PagedRunner, assert_within_activation_rounding, held_weights, hf_greedy,
                             prompts_of_lengths, run_greedy, tiny_models_with_reference)

# The bound on |our logit - transformers' logit|, relative to the logits' scale (at least 1).
# Both run the same float32 operations, in the same order outside reductions (the MoE block
# too: softmax, top-k, renormalization, experts summed in ascending id, each expert's rows in
# transformers' order). Only reductions may be ordered differently: the matmuls (the BLAS
# kernel blocks by row count, and our steps batch other tokens) and paged attention.
# Reordering a float32 sum of n terms moves it by at most gamma_n * sum|terms|,
# gamma_n ~ n * 2**-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1); the
# widest reduction here has n = 128 terms: 7.6e-6. A logit lies at the end of a chain of
# at most 6 reductions per layer (QKV, scores, weighted values, output, gate/up, down)
# over 3 layers plus the LM head: 19 stages. With RMSNorm rescaling every layer's input
# and sum|terms| about the size of the result for these random weights (no cancellation
# by design: a large init range), the errors add to at most 19 * 7.6e-6 = 1.5e-4 of the
# logits' scale.
MAX_RELATIVE_DIFF = 1.5e-4
NUM_NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models_with_reference(tmp_path_factory)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_matches_transformers_on_paged_kv(models, family):
    """A mixed batch (prefill chunks of 11 next to one-token steps) on blocks of 4: the
    greedy tokens equal transformers', the logits within the derived bound.

    Only prompts whose every routing decision (prompt and continuation, every sparse layer)
    is clear of a tie by more than our rounding can move it are compared: within that
    margin the two may pick different experts, which no bound on rounding covers. Random
    routers put one of a few hundred decisions that close about every other prompt, so
    the test draws twelve and needs four, one of them long enough for several chunks."""
    hf, config = models(family)
    assert config.is_moe and config.sparse_layers == ([True, False, True] if family == "qwen3_moe" else [True, True])
    model = load_model(config)
    candidates = prompts_of_lengths([3, 29, 17, 40, 1, 8, 23, 35, 12, 5, 26, 14])
    expected = {req_id: hf_greedy(hf, prompt, NUM_NEW) for req_id, prompt in candidates.items()}
    prompts = {req_id: prompt for req_id, prompt in candidates.items()
               if min_router_margin(hf, prompt + expected[req_id][0]) > 2 * MAX_RELATIVE_DIFF}
    assert len(prompts) >= 4 and max(map(len, prompts.values())) > 20
    tokens, logits = run_greedy(PagedRunner(model, block_size=4), prompts, NUM_NEW, chunk=11)
    # one-token steps ran in the native decoder (gpt-oss too: tests/model/test_native_gpt_oss.py)
    assert model.native_decoder is not None
    for req_id in prompts:
        ref_tokens, ref_logits = expected[req_id]
        assert tokens[req_id] == ref_tokens, req_id
        for ours, ref in zip(logits[req_id], ref_logits):
            assert (ours - ref).abs().max().item() <= MAX_RELATIVE_DIFF * max(1.0, ref.abs().max().item())


def test_stacked_expert_checkpoint_loads_like_per_expert_one(models, tmp_path):
    """transformers 5's in-memory layout (experts stacked: gate_up [E, 2I, hidden], down
    [E, hidden, I]) saved as is loads into the same weights as the per-expert checkpoint."""
    import shutil

    from safetensors.torch import save_file
    hf, config = models("qwen3_moe")
    stacked = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in stacked)
    shutil.copy(f"{config.path}/config.json", tmp_path / "config.json")
    save_file(stacked, str(tmp_path / "model.safetensors"))
    ours = load_model(ModelConfig.from_path(str(tmp_path)))
    reference = load_model(config)
    for (name, a), (_, b) in zip(ours.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


# ---- routing edge cases: one MoE block against transformers' block -------------------

def _block_pair(models, family: str, top_k: int | None = None) -> tuple[SparseMoeBlock, torch.nn.Module]:
    """Our first sparse layer's block and transformers' (same weights), optionally at top-k."""
    hf, config = models(family)
    ours = load_model(config).layers[0].mlp
    theirs = hf.model.layers[0].mlp
    assert isinstance(ours, SparseMoeBlock)
    if top_k is not None:
        ours.top_k = _router(theirs).top_k = top_k
    return ours, theirs


def _router(hf_block):
    return getattr(hf_block, "gate", None) or hf_block.router  # gpt-oss calls it the router


@torch.inference_mode()
def _set_router(ours: SparseMoeBlock, theirs, weight: torch.Tensor) -> None:
    for router in (ours.gate, _router(theirs)):
        router.weight.copy_(weight)
        if getattr(router, "bias", None) is not None:
            router.bias.zero_()


@torch.inference_mode()
def _both(ours: SparseMoeBlock, theirs, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(our output, transformers' output, transformers' expert ids) for x [T, hidden]."""
    _, _, ids = _router(theirs)(x)
    out = theirs(x.unsqueeze(0))
    return ours(x), (out[0] if isinstance(out, tuple) else out)[0], ids  # gpt-oss adds the router scores


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # Same operations in the same order (see MAX_RELATIVE_DIFF); one block's chain is three
    # reductions of at most 64 terms: 3 * 64 * 2**-24 = 1.2e-5 of its scale.
    assert (ours - ref).abs().max().item() <= 1.2e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_gate_ties_break_as_transformers(models, family):
    """Tied gate scores pick experts in torch.topk's order, as transformers does: a zero
    router ties all experts for every token; a router whose rows repeat ties pairs."""
    ours, theirs = _block_pair(models, family)
    x = torch.randn(7, ours.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    num_experts = ours.num_experts
    _set_router(ours, theirs, torch.zeros(num_experts, x.shape[1]))
    weights, ids = route(ours.gate(x), ours.top_k, ours.renormalize, ours.softmax_after_topk)
    out, ref, ref_ids = _both(ours, theirs, x)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(ids, torch.topk(torch.full((7, num_experts), 1.0 / num_experts), ours.top_k).indices)
    _assert_close(out, ref)
    rows = torch.randn(num_experts // 2, x.shape[1], generator=torch.Generator().manual_seed(4))
    _set_router(ours, theirs, torch.cat([rows, rows]))  # expert e and e + E/2 tie exactly
    _, ids = route(ours.gate(x), ours.top_k, ours.renormalize, ours.softmax_after_topk)
    out, ref, ref_ids = _both(ours, theirs, x)
    assert torch.equal(ids, ref_ids)
    assert ((ids[:, 0] - ids[:, 1]).abs() == num_experts // 2).all()  # each token's pick is a tied pair
    _assert_close(out, ref)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_no_token_picks_are_never_read(models, family, top_k):
    """With positive inputs, a router row of -1s is never in any token's top k, and rows of
    +2s (the first top_k experts) always are: every token goes to the same experts. The
    unpicked experts' weights are NaN: any read of them would poison the output."""
    ours, theirs = _block_pair(models, family, top_k)
    hidden = ours.gate.weight.shape[1]
    x = torch.rand(9, hidden, generator=torch.Generator().manual_seed(5)) + 0.1
    router = torch.rand(ours.num_experts, hidden, generator=torch.Generator().manual_seed(6))
    router[:top_k] = 2.0
    router[-1] = -1.0
    _set_router(ours, theirs, router)
    with torch.inference_mode():
        for expert in ours.experts[top_k:]:
            for param in expert.parameters():
                param.fill_(float("nan"))
    out, ref, ref_ids = _both(ours, theirs, x)
    assert sorted(set(ref_ids.flatten().tolist())) == list(range(top_k))
    assert torch.isfinite(out).all()
    _assert_close(out, ref)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_renormalization_follows_the_family(models, family):
    """Mixtral and this Qwen3-MoE renormalize the top-k weights to sum to 1, gpt-oss takes a
    softmax over them; OLMoE does not."""
    ours, _ = _block_pair(models, family)
    x = torch.randn(5, ours.gate.weight.shape[1], generator=torch.Generator().manual_seed(7))
    weights, _ = route(ours.gate(x), ours.top_k, ours.renormalize, ours.softmax_after_topk)
    sums = weights.sum(-1)
    if family == "olmoe":
        assert (sums < 1 - 1e-3).all()
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums))


# ---- GGUF experts held quantized ----------------------------------------------------------

@pytest.mark.parametrize(("family", "qtype_name"), [("qwen3_moe", "Q4_0"), ("mixtral", "Q8_0"), ("olmoe", "Q4_0")])
def test_quantized_gguf_experts_match_dequantized_model(models, tmp_path, monkeypatch, family, qtype_name):
    """Experts stored as stacked Q8_0/Q4_0 tensors: each expert is held as its own 2-D slice
    as stored (the same values as the dequantizing loader's), and the model's logits under
    teacher forcing stay within the activation-rounding bound (tests/helpers/activation_rounding.py)
    of the same file dequantized to float32.

    At int16 activation rounding: at int8 (the default) the rounding moves router logits
    by about 1e-2 of their scale, which flips the near-tied routing decisions that random
    routers make every few hundred (llama.cpp's flip alike); a flipped expert is a jump no
    rounding bound covers. The kernels' weight arithmetic is the same at either setting."""
    gguf = pytest.importorskip("gguf")
    from helpers.gguf_writer import write_gguf
    from helpers.kernel_switches import env_kernels
    from kvserve.model import quantized
    kernels = env_kernels(quant_gemm_rows=0, quant_panel_rows=0, quant_act_bits=16)
    if quantized.kernel_isa(kernels) is None:
        pytest.skip("no native kernels")
    hf, _ = models(family)
    path = str(tmp_path / f"{family}-{qtype_name}.gguf")
    write_gguf(hf, path, getattr(gguf.GGMLQuantizationType, qtype_name))
    config = ModelConfig.from_path(path)
    assert config.architecture == hf.config.architectures[0] and config.is_moe
    held = load_model(config, kernel_config=kernels)
    plain = load_model(ModelConfig.from_path(path, quantization="none", dtype="float32"))
    experts = {name: weight for name, weight in held_weights(held, plain).items() if ".experts." in name}
    assert len(experts) == 2 * config.num_experts * sum(config.sparse_layers)  # gate_up and down of each
    assert {weight.source_type for weight in experts.values()} == {qtype_name}  # as stored, not widened
    native_steps = count_native_steps(monkeypatch)
    assert_within_activation_rounding(held, plain)
    # its one-token steps ran in the native decoder (csrc/decoder/fused_decoder.c's moe_mlp)
    assert native_steps[0] > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_experts_shard_across_tensor_parallel_ranks(models, monkeypatch, family):
    """Two ranks load their shard of every expert (gate/up rows, down columns; the router
    whole); their partial sums add up to the unsharded block's output. No process group:
    the all-reduce is the sum taken here. Bound: each output is the same float32 sum split
    in two halves of 16 terms (reordered, 32 * 2**-24 of its terms' magnitude) on top of
    the block's own rounding (see `_assert_close`)."""
    from kvserve.model.parallel import TPContext
    _, config = models(family)
    full = load_model(config).layers[0].mlp
    ranks = [load_model(config, tp_rank=rank, tp_size=2).layers[0].mlp for rank in range(2)]
    assert ranks[0].experts[0].gate_up_proj.weight.shape[0] == full.experts[0].gate_up_proj.weight.shape[0] // 2
    monkeypatch.setattr(TPContext, "all_reduce", lambda self, tensor: tensor)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        _assert_close(ranks[0](x) + ranks[1](x), full(x))
    if family == "gpt_oss":  # each rank keeps its query heads' attention sinks
        sinks = [load_model(config, tp_rank=rank, tp_size=2).layers[0].self_attn.sinks for rank in range(2)]
        assert torch.equal(torch.cat(sinks), load_model(config).layers[0].self_attn.sinks)


def test_projection_wide_qk_norm_refuses_tensor_parallelism(models):
    """OLMoE's Q/K norm spans every head: a rank holding some heads cannot compute it alone."""
    _, config = models("olmoe")
    with pytest.raises(ValueError, match="tensor parallelism"):
        load_model(config, tp_rank=0, tp_size=2)


def test_tensor_parallel_checks_name_what_does_not_split(models):
    """Before any process starts: an expert width the ranks do not divide, or OLMoE's Q/K norm
    over all heads, is a one-line configuration error."""
    import dataclasses

    from kvserve.config import ConfigError
    from kvserve.worker.tp_executor import check_model_splits
    _, qwen = models("qwen3_moe")
    check_model_splits(qwen, 2)
    with pytest.raises(ConfigError, match="expert width of 33"):
        check_model_splits(dataclasses.replace(qwen, moe_intermediate_size=33), 2)
    _, olmoe = models("olmoe")
    with pytest.raises(ConfigError, match="all heads"):
        check_model_splits(olmoe, 2)


@pytest.mark.parametrize("qtype_name", ["Q4_K", "Q6_K"])
def test_k_quant_expert_stacks_are_held_per_expert_as_stored(tmp_path, qtype_name):
    """A stacked 3-D K-quant expert tensor (random blocks with finite scales: gguf-py cannot
    quantize K types) comes out of the GGUF reader as one quantized weight per expert, each
    dequantizing to gguf-py's values for that expert's slice (to float32 rounding), with no widening."""
    gguf = pytest.importorskip("gguf")
    from kvserve.model.gguf_loader import iter_gguf_tensors
    from kvserve.model.quantized import QuantizedWeight
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    block_bytes, scale_at = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[qtype_name]
    num_experts, rows, cols = 3, 8, 512
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (num_experts, rows, cols // 256, block_bytes), dtype=np.uint8)
    for offset in scale_at:  # the f16 super-block scales (Q4_K: d and dmin; Q6_K: d)
        raw[..., offset:offset + 2] = np.array([0.01], np.float16).view(np.uint8)
    raw = raw.reshape(num_experts, rows, -1)
    path = str(tmp_path / "experts.gguf")
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    held = dict(iter_gguf_tensors(path, 4, 2, keep_quantized=lambda name: True))
    assert sorted(held) == [f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(num_experts)]
    for expert in range(num_experts):
        weight = held[f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"]
        assert isinstance(weight, QuantizedWeight) and weight.source_type == qtype_name
        assert weight.bits == (4 if qtype_name == "Q4_K" else 16)  # as stored: Q6_K's own 16-bit form
        expected = gguf.quants.dequantize(raw[expert], qtype)
        np.testing.assert_allclose(weight.dequantize().numpy(), expected, rtol=1e-6, atol=1e-7)
