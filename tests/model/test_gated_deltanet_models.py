"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet + gated full attention) against
transformers in float32: chunked prefill crossing block boundaries next to one-token steps,
restarts from a state snapshot (a prefix hit) and from zeros (a recompute after preemption).

Bound on |our logit - transformers' logit|, relative to the logits' scale (at least 1): both
run the same float32 operations; they differ in the order of reductions (matmul blocking,
attention, and the chunked delta rule: our chunks also end at block boundaries, transformers'
every 64 tokens). Reordering a sum of n float32 terms moves it by at most gamma_n ~ n 2**-24
of sum |terms| (Higham 3.1); every reduction here has at most 128 terms (7.6e-6), the delta
rule's per-token error included ((Dk + C + 10) = 90 terms of rounding, see
tests/model/test_gated_delta.py). A layer chains at most 8 of them (Gated DeltaNet: input
projection, convolution, L2 norm, delta rule, gated norm, output projection, then the MLP's
two; attention: QKV, Q/K norm, scores, values, output, then the MLP's two), four layers and
the LM head 33 stages: 2.5e-4. Errors in a delta-rule state only shrink later (its update is a
contraction, see the kernel test), but the chunk's triangular solve amplifies its rounding
by the Skeel condition number, below 2 on such data (measured in the kernel test): 5e-4.
Greedy tokens are compared only where transformers' top two logits, and every routing
decision, are more than twice that apart; the rest is compared under teacher forcing.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.kv_cache.interface import StateSpec
from kvserve.model.config import ModelConfig
from kvserve.model.errors import ModelConfigError
from kvserve.model.loader import load_model
from helpers.tiny_models import GATED_DELTANET_FAMILIES, min_router_margin, tiny_gated_deltanet_config
from paged_kv_helper import hf_forced_logits, hf_greedy, load_hf, prompts_of_lengths, run_greedy
from hybrid_runner import HybridRunner

MAX_RELATIVE_DIFF = 5e-4
NUM_NEW = 6
VOCAB = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(family: str):
        if family not in cache:
            torch.manual_seed(0)
            path = str(tmp_path_factory.mktemp(family))
            config = tiny_gated_deltanet_config(family, VOCAB)
            transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval().save_pretrained(path)
            cache[family] = (load_hf(path), ModelConfig.from_path(path))
        return cache[family]
    return get


def _scale(logits: torch.Tensor) -> float:
    return max(1.0, logits.abs().max().item())


def _clear_of_ties(hf, prompt: list[int], expected: tuple[list[int], list[torch.Tensor]]) -> bool:
    """Whether transformers' greedy run of `prompt` has no near-tie our rounding could flip:
    top-2 logit gaps and (MoE) routing margins above twice the bound."""
    tokens, logits = expected
    margin = 2 * MAX_RELATIVE_DIFF
    gaps = [(row.topk(2).values[0] - row.topk(2).values[1]).item() / _scale(row) for row in logits]
    routed = getattr(hf.config, "num_experts", 0) and min_router_margin(hf, prompt + tokens) <= margin
    return min(gaps) > margin and not routed


def _assert_close(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max().item() <= MAX_RELATIVE_DIFF * _scale(b)


@pytest.mark.parametrize("family", GATED_DELTANET_FAMILIES)
def test_matches_transformers_with_chunked_prefill(models, family):
    """Prompts of 1 to 40 tokens in chunks of 7 on blocks of 4 (state snapshots inside chunks),
    prefill next to decode: greedy tokens equal transformers' where clear of ties, and every
    request's logits, teacher forced on our tokens, within the bound."""
    hf, config = models(family)
    assert config.layer_types == ["linear_attention"] * 3 + ["full"]
    model = load_model(config)
    assert model.native_decoder is None
    prompts = prompts_of_lengths([3, 29, 17, 40, 1, 8, 23, 12])
    tokens, logits = run_greedy(HybridRunner(model), prompts, NUM_NEW, chunk=7)
    compared = 0
    for req_id, prompt in prompts.items():
        _assert_close(logits[req_id], hf_forced_logits(hf, prompt, tokens[req_id]))
        expected = hf_greedy(hf, prompt, NUM_NEW)
        if _clear_of_ties(hf, prompt, expected):
            assert tokens[req_id] == expected[0], req_id
            compared += 1
    assert compared >= 4


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_restart_from_snapshot_and_from_zeros(models, family):
    """A request sharing 16 tokens of another's prompt starts from that one's snapshot after
    token 16 (a prefix hit: attention blocks shared, the snapshot read, its own slots written);
    a preempted request recomputes from zeros. Both continue as transformers does, and the
    snapshot the first request wrote is left as it was."""
    hf, config = models(family)
    runner = HybridRunner(load_model(config))
    prompts = prompts_of_lengths([21, 9], seed=3)
    first = prompts["r0"]
    hit = first[:16] + prompts["r1"]
    run_greedy(runner, {"a": first}, NUM_NEW, chunk=6)
    snapshot_slot = runner.requests["a"].snapshots[16]
    snapshot = [tensor[snapshot_slot].clone() for name in runner.state_layers for tensor in runner.kv_caches[name]]
    assert all(t.abs().max() > 0 for t in snapshot)
    runner.add("b", hit, hit_from="a", hit_tokens=16)
    tokens, logits = run_greedy(runner, {"b": hit}, NUM_NEW, chunk=5)
    _assert_close(logits["b"], hf_forced_logits(hf, hit, tokens["b"]))
    after = [tensor[snapshot_slot] for name in runner.state_layers for tensor in runner.kv_caches[name]]
    assert all(torch.equal(a, b) for a, b in zip(snapshot, after))
    # Preempted: its prompt and output so far are recomputed from zeros (a new running slot), then it goes on.
    recomputed = hit + tokens["b"]
    more_tokens, more_logits = run_greedy(runner, {"b again": recomputed}, NUM_NEW, chunk=5)
    _assert_close(more_logits["b again"], hf_forced_logits(hf, recomputed, more_tokens["b again"]))


def test_state_specs_and_config(models):
    """Gated DeltaNet layers get a StateSpec of their conv inputs and delta-rule state (float32
    whatever the KV dtype), the full-attention layer a KV spec; a config without the linear
    sizes is refused with a clear error."""
    _, config = models("qwen3_next")
    specs = load_model(config).kv_cache_specs(4, torch.bfloat16)
    states = [spec for name, spec in specs.items() if name.endswith("linear_attn.state")]
    assert len(states) == 3 and all(isinstance(s, StateSpec) for s in states)
    conv_dim = 2 * 2 * 16 + 4 * 8
    assert states[0].shapes == ((3, conv_dim), (4, 16, 8)) and states[0].dtype == torch.float32
    assert states[0].page_size_bytes == (3 * conv_dim + 4 * 16 * 8) * 4
    assert specs["model.layers.3.self_attn.attn"].dtype == torch.bfloat16
    hf = tiny_gated_deltanet_config("qwen3_next", VOCAB).to_dict()
    hf["architectures"] = ["Qwen3NextForCausalLM"]
    del hf["linear_num_key_heads"]
    with pytest.raises((ModelConfigError, KeyError)):
        ModelConfig.from_hf_dict(hf)
    # transformers 4.x's layout (Qwen3-Next's hub config): RoPE and its partial factor at the top
    # level, the layer pattern as an interval.
    hf = tiny_gated_deltanet_config("qwen3_next", VOCAB).to_dict()
    for key in ("rope_parameters", "layer_types"):
        del hf[key]
    hf.update(architectures=["Qwen3NextForCausalLM"], rope_theta=5e6, partial_rotary_factor=0.5,
              full_attention_interval=2)
    legacy = ModelConfig.from_hf_dict(hf)
    assert legacy.rope.theta == 5e6 and legacy.rope.partial_rotary_factor == 0.5
    assert legacy.layer_types == ["linear_attention", "full"] * 2
    del hf["partial_rotary_factor"]
    assert ModelConfig.from_hf_dict(hf).rope.partial_rotary_factor == 0.25
    hf = tiny_gated_deltanet_config("qwen3_5", VOCAB).to_dict()
    hf.update(architectures=["Qwen3_5ForCausalLM"], layer_types=["linear_attention", "mamba", "full_attention",
                                                                 "linear_attention"])
    with pytest.raises(ModelConfigError, match="mamba"):
        ModelConfig.from_hf_dict(hf)


def test_native_decode_step_agrees_with_torch(models, monkeypatch):
    """Under native ops one-token steps take the C step kernel (csrc/ssm/gated_delta_step.c),
    else the torch step: teacher forced on the same tokens, both within the bound of
    transformers, so within twice it of each other."""
    from kvserve.model.kernels import ModelKernels
    from kvserve.native import cpu_kernels
    from paged_kv_helper import run_teacher_forced
    if cpu_kernels.load_library() is None:
        pytest.skip("no native library")
    _, config = models("qwen3_5")
    sequences = prompts_of_lengths([14, 9, 20], seed=5)
    prompt_lens = {"r0": 6, "r1": 9, "r2": 11}
    calls = []
    step = cpu_kernels.gated_delta_step
    monkeypatch.setattr(cpu_kernels, "gated_delta_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    native = load_model(config)
    logits = run_teacher_forced(HybridRunner(native), sequences, prompt_lens, chunk=4)
    assert calls and all(layer.linear_attn.native for layer in native.layers if layer.is_state_layer)
    plain = load_model(config)
    plain.use_kernels(ModelKernels.torch_only())
    calls.clear()
    reference = run_teacher_forced(HybridRunner(plain), sequences, prompt_lens, chunk=4)
    assert not calls
    for req_id, rows in reference.items():
        for ours, ref in zip(logits[req_id], rows):
            assert (ours - ref).abs().max().item() <= 2 * MAX_RELATIVE_DIFF * _scale(ref)


def test_multimodal_qwen3_5_checkpoint_serves_its_language_model(tmp_path):
    """Qwen3.5's released checkpoints are `Qwen3_5ForConditionalGeneration` (a vision tower
    beside the language model, whose tensors sit under `model.language_model.`): the text
    model is read from `text_config`, the vision tensors ignored, and a text prompt's logits
    (multimodal RoPE over text-only positions is plain RoPE) match transformers' within the bound."""
    torch.manual_seed(0)
    text = tiny_gated_deltanet_config("qwen3_5", VOCAB).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=1, num_position_embeddings=16)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    hf.save_pretrained(str(tmp_path))
    config = ModelConfig.from_path(str(tmp_path))
    assert config.architecture == "Qwen3_5ForCausalLM" and config.layer_types[:3] == ["linear_attention"] * 3
    prompt = prompts_of_lengths([19], seed=9)["r0"]
    runner = HybridRunner(load_model(config))
    runner.add("r", prompt)
    ours = runner.step({"r": len(prompt)})["r"]
    with torch.inference_mode():
        theirs = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert (ours - theirs).abs().max().item() <= MAX_RELATIVE_DIFF * _scale(theirs)
