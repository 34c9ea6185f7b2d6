"""Granite 4 hybrids (GraniteMoeHybridForCausalLM: Mamba-2 + attention layers, routed and shared
experts, Granite's multipliers) against transformers in float32, driven by hand over attention
blocks and state slots (hybrid_runner.py): chunked prefill with snapshots inside chunks, mixed
batches, and prompts resumed from another request's snapshot (a prefix hit)."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.kv_cache.interface import FullAttentionSpec, StateSpec
from kvserve.model.config import ModelConfig
from kvserve.model.kernels import ModelKernels
from kvserve.model.loader import load_model
from kvserve.native import cpu_kernels
from helpers.tiny_models import GRANITE_HYBRID_BOUND, min_router_margin, tiny_granite_hybrid_config
from hybrid_runner import HybridRunner
from paged_kv_helper import hf_forced_logits, hf_greedy, load_hf, prompts_of_lengths, run_greedy

VOCAB = 256
NUM_NEW = 6
# The bound on |our logit - transformers' logit| relative to the logits' scale, derived where
# the tiny config is defined (helpers/tiny_models.py).
MAX_RELATIVE_DIFF = GRANITE_HYBRID_BOUND


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            torch.manual_seed(0)
            config = tiny_granite_hybrid_config(VOCAB, experts=variant == "moe", rope=variant == "dense_rope")
            hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
            path = str(tmp_path_factory.mktemp(variant))
            hf.save_pretrained(path)
            cache[variant] = (load_hf(path), ModelConfig.from_path(path))
        return cache[variant]
    return get


def _clear(hf, prompt: list[int], tokens: list[int], logits: list[torch.Tensor], experts: bool) -> bool:
    """Whether transformers' greedy choice and (with experts) its routing are clear of ties by
    more than twice the bound: only then must two float32 evaluations agree on them."""
    for row in logits:
        top = row.topk(2).values
        if (top[0] - top[1]).item() <= 2 * MAX_RELATIVE_DIFF * max(1.0, row.abs().max().item()):
            return False
    return not experts or min_router_margin(hf, prompt + tokens) > 2 * MAX_RELATIVE_DIFF


def _reference(hf, prompts: dict[str, list[int]], experts: bool):
    expected = {req_id: hf_greedy(hf, prompt, NUM_NEW) for req_id, prompt in prompts.items()}
    kept = {req_id: prompt for req_id, prompt in prompts.items()
            if _clear(hf, prompt, *expected[req_id], experts=experts)}
    return kept, expected


def _run(runner: HybridRunner, prompts: dict[str, list[int]], chunk: int):
    """Greedy continuous batching: prompts in chunks of up to `chunk`, then one token a step."""
    return run_greedy(runner, prompts, NUM_NEW, chunk)


def _assert_matches(tokens, logits, expected, prompts) -> None:
    for req_id in prompts:
        ref_tokens, ref_logits = expected[req_id]
        assert tokens[req_id] == ref_tokens, req_id
        for ours, ref in zip(logits[req_id], ref_logits):
            assert (ours - ref).abs().max().item() <= MAX_RELATIVE_DIFF * max(1.0, ref.abs().max().item())


def test_config_and_kv_specs(models):
    _, config = models("moe")
    assert config.family == "granitemoehybrid" and config.layer_types == ["mamba", "full", "mamba", "mamba"]
    assert (config.mamba.num_heads, config.mamba.head_dim, config.mamba.state_size, config.mamba.n_groups,
            config.mamba.conv_kernel) == (8, 16, 16, 2, 4)
    # transformers 5 writes the default time-step limit's infinity as {"__float__": "Infinity"}.
    assert (config.mamba.dt_min, config.mamba.dt_max) == (0.0, float("inf"))
    assert config.shared_expert_size == 48 and config.moe_intermediate_size == 32 and config.softmax_after_topk
    assert not config.use_rope and config.attention_scale == 0.25
    specs = load_model(config).kv_cache_specs(4)
    assert isinstance(specs["model.layers.1.self_attn.attn"], FullAttentionSpec)
    state = specs["model.layers.0.mamba.state"]
    # conv state: the last 3 inputs of 128 + 2 * 2 * 16 conv channels; SSM state: heads x channels x state.
    assert isinstance(state, StateSpec) and state.shapes == ((3, 192), (8, 16, 16))
    assert state.page_size_bytes == (3 * 192 + 8 * 16 * 16) * 4


@pytest.mark.parametrize("variant,native", [("moe", True), ("dense_rope", True), ("dense_rope", False)])
def test_hybrid_matches_transformers_with_chunked_prefill(models, variant, native):
    """A mixed batch, prompts in chunks of 5 over blocks of 4 (snapshots inside chunks),
    next to one-token steps: greedy tokens equal transformers', logits within the bound;
    decode steps through the C Mamba-2 step (`native`, its widest path here) or torch."""
    hf, config = models(variant)
    model = load_model(config)
    if not native:
        model.use_kernels(ModelKernels.torch_only())
    elif cpu_kernels.load_library() is None:
        pytest.skip("no native kernels")
    assert all(layer.mixer.native == native for layer in model.layers if layer.is_state_layer)
    assert model.native_decoder is None
    prompts, expected = _reference(hf, prompts_of_lengths([3, 29, 17, 40, 1, 8, 23, 12]), variant == "moe")
    assert len(prompts) >= 4 and max(map(len, prompts.values())) > 20
    _assert_matches(*_run(HybridRunner(model), prompts, chunk=5), expected, prompts)


def test_prefix_hit_resumes_from_a_state_snapshot(models):
    """A second prompt sharing 16 tokens with a first starts from the first's snapshot after
    token 16 (and its attention blocks): its logits match transformers' on its whole prompt."""
    hf, config = models("dense_rope")
    model = load_model(config)
    first = prompts_of_lengths([22], seed=3)["r0"]
    second = first[:16] + prompts_of_lengths([9], seed=4)["r0"]
    runner = HybridRunner(model)
    runner.add("first", first)
    runner.step({"first": 7})
    runner.step({"first": 15})
    runner.add("second", second, hit_from="first", hit_tokens=16)
    out = runner.step({"second": 9})["second"]
    reference = hf_forced_logits(hf, second, [0])[0]
    assert (out - reference).abs().max().item() <= MAX_RELATIVE_DIFF * max(1.0, reference.abs().max().item())
    # Starting from zeros instead (no hit) gives another result: the snapshot was read.
    fresh = HybridRunner(model)
    fresh.add("second", second[16:])
    assert (fresh.step({"second": 9})["second"] - reference).abs().max().item() > 0.1


def test_granite_layer_types_by_either_name():
    """IBM's checkpoints name layers "mamba"/"attention", transformers 5 "linear_attention"/
    "full_attention"; other names are refused."""
    base = tiny_granite_hybrid_config(VOCAB).to_dict()
    for names in (["mamba", "attention", "mamba", "mamba"],
                  ["linear_attention", "full_attention", "linear_attention", "linear_attention"]):
        config = ModelConfig.from_hf_dict({**base, "layer_types": names})
        assert config.layer_types == ["mamba", "full", "mamba", "mamba"]
    from kvserve.model.errors import ModelConfigError
    with pytest.raises(ModelConfigError, match="layer types"):
        ModelConfig.from_hf_dict({**base, "layer_types": ["mamba", "sliding_attention", "mamba", "mamba"]})
