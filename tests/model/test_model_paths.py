"""Every model feature on both model paths, from one table.

kvserve runs a decoder two ways (docs/architecture.md, "The two model paths"): the
per-op path (`model/decoder.py`, torch modules op by op: the reference) and the fast
path (`native/csrc/decoder/fused_decoder.c`, every layer of a small step in one native
call). Each feature of `ModelConfig` (a row of FEATURES) is run on both paths, with the
same tokens fed whatever the logits say (teacher forcing: prompt chunks of 2 and single
decode steps, so the fast path takes the prompts over cached context too; hybrids with
recurrent-state layers one token a step, the steps the fast path runs them in), and both
paths' float32 logits are compared with transformers' in float64 (an independent
implementation, near exact). A feature added to `ModelConfig` fails
`test_every_model_config_field_is_a_row_or_not_a_feature` until it has a row here, so
it cannot reach one path and silently miss the other.

The tensor-parallel reduce inside the native call needs two ranks (processes); its
native-against-per-op check is tests/tp/test_tp_native_decoder.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.native import cpu_kernels
from paged_kv_helper import VOCAB, PagedRunner, load_hf, run_teacher_forced, tiny_hf_config

from helpers.native_steps import count_native_steps
from helpers.tiny_models import GATED_DELTANET_FAMILIES, tiny_gated_deltanet_config, tiny_granite_hybrid_config
from hybrid_runner import HybridRunner

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

# feature -> (the tiny model that has it: family and changes to its transformers config,
#            whether a ModelConfig has it on)
FEATURES = {
    "grouped-query attention": ("llama", {}, lambda c: c.num_kv_heads < c.num_heads),
    "untied LM head": ("llama", {}, lambda c: not c.tie_word_embeddings),
    "tied embeddings": ("qwen2", {}, lambda c: c.tie_word_embeddings),
    "attention biases": ("qwen2", {}, lambda c: c.attention_bias),
    "Q/K norms": ("qwen3", {}, lambda c: c.qk_norm),
    "llama3 RoPE scaling": ("llama3", {}, lambda c: c.rope.rope_type == "llama3"),
    "sliding-window attention": ("mistral", {}, lambda c: c.sliding_window and "sliding" in c.layer_types),
    "sandwich norms": ("gemma2", {}, lambda c: c.sandwich_norms),
    "RMSNorm scaled by 1 + w": ("gemma2", {}, lambda c: c.norm_adds_one),
    "scaled embeddings": ("gemma2", {}, lambda c: c.scales_embeddings),
    "attention soft-capping": ("gemma2", {}, lambda c: c.attn_logit_softcapping),
    "final logit soft-capping": ("gemma2", {}, lambda c: c.final_logit_softcapping),
    "query_pre_attn_scalar": ("gemma2", {"query_pre_attn_scalar": 24}, lambda c: c.query_pre_attn_scalar
                              and c.attention_scale != c.head_dim ** -0.5),
    "GELU (tanh) MLP": ("gemma3", {}, lambda c: c.hidden_act.startswith("gelu")),
    "local RoPE on sliding layers": ("gemma3", {}, lambda c: c.rope_local is not None),
    "linear RoPE scaling": ("gemma3", {}, lambda c: c.rope.rope_type == "linear"),
    "head_dim apart from hidden / heads": ("qwen3", {}, lambda c: c.head_dim * c.num_heads != c.hidden_size),
    "mixture of experts, top-k renormalized, dense layers between": (
        "qwen3_moe", {}, lambda c: c.is_moe and c.norm_topk_prob and not all(c.sparse_layers)),
    "mixture of experts on sliding-window layers": ("mixtral", {}, lambda c: c.is_moe and c.sliding_window),
    "mixture of experts, top-k weights as is (OLMoE's routing)": (
        "qwen3_moe", {"norm_topk_prob": False}, lambda c: c.is_moe and not c.norm_topk_prob),
    "mixture of experts, top-k as is; Q/K norm over the whole projection": (
        "olmoe", {}, lambda c: c.is_moe and not c.norm_topk_prob and not c.qk_norm_per_head),
    # Qwen3.5 (dense): driven by HybridRunner (a state group beside the attention one), one token
    # a step (the native decoder runs state layers at decode steps only), so every step native.
    "Gated DeltaNet layers, key heads shared by value heads": (
        "qwen3_5", {}, lambda c: "linear_attention" in c.layer_types
        and c.linear_num_value_heads > c.linear_num_key_heads and c.linear_conv_kernel_dim > 1
        and c.linear_key_head_dim != c.linear_value_head_dim),
    "attention output gated by sigmoid": ("qwen3_5", {}, lambda c: c.attn_output_gate),
    "partial RoPE": ("qwen3_5", {}, lambda c: c.rope.partial_rotary_factor < 1.0),
    # Granite 4 without routed experts (its MLP the shared one), driven as Qwen3.5 is.
    "Mamba-2 layers": ("granitemoehybrid", {}, lambda c: c.mamba is not None and "mamba" in c.layer_types),
    "attention without RoPE": ("granitemoehybrid", {}, lambda c: not c.use_rope),
    "Granite's embedding, residual and attention multipliers, logits scaling": (
        "granitemoehybrid", {}, lambda c: c.embedding_multiplier != 1.0 and c.residual_multiplier != 1.0
        and c.logits_scaling != 1.0 and c.attention_multiplier not in (None, 1.0)),
    "mixture of experts with a gated shared expert, Gated DeltaNet layers": (
        "qwen3_5_moe", {}, lambda c: c.is_moe and c.shared_expert_intermediate_size and all(c.sparse_layers)),
    "mixture of experts with a gated shared expert, dense layers between": (
        "qwen3_next", {}, lambda c: c.shared_expert_intermediate_size and not all(c.sparse_layers)),
    "gpt-oss: attention sinks, sliding and full layers, YaRN RoPE, softmax after top-k, router bias, "
    "biased clamped-SwiGLU experts, O bias": (
        "gpt_oss", {}, lambda c: c.attention_sinks and c.softmax_after_topk and c.router_bias and c.expert_bias
        and c.swiglu_limit and c.swiglu_alpha and c.o_proj_bias and not c.rope.truncate
        and c.rope.rope_type == "yarn" and c.layer_types == ["sliding", "full"]),
}
# Families HybridRunner drives (a state group beside the attention one), one token a step.
HYBRID_FAMILIES = (*GATED_DELTANET_FAMILIES, "granitemoehybrid")
# Features the native decoder declines (`NativeDecoder.for_model` returns None): the fast
# path falls back to the per-op path for every step, and both stay within the bound.
DECLINED_FEATURES = {
    "clipped Q/K/V": ("olmoe", {"clip_qkv": 0.5}, lambda c: c.clip_qkv),
}
# The ModelConfig fields each row above reads (a new field must join a row or NOT_FEATURES).
FEATURE_FIELDS = {"num_kv_heads", "tie_word_embeddings", "attention_bias", "qk_norm", "rope", "sliding_window",
                  "layer_types", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                  "hidden_act", "rope_local", "head_dim", "family", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "norm_topk_prob", "sparse_layers", "qk_norm_per_head", "clip_qkv",
                  "softmax_after_topk", "router_bias", "expert_bias", "swiglu_limit", "swiglu_alpha",
                  "attention_sinks", "o_proj_bias", "linear_num_key_heads", "linear_num_value_heads",
                  "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "attn_output_gate",
                  "shared_expert_intermediate_size", "mamba", "use_rope", "embedding_multiplier",
                  "residual_multiplier", "logits_scaling", "attention_multiplier"}
# Hybrid models' fields the native decoder declines: Granite's shared expert beside its routed
# ones (tests/model/test_granite_hybrid.py runs the per-op path against transformers).
HYBRID_FIELDS = {"shared_expert_size"}
# Identity, sizes and token ids: the same arithmetic on both paths whatever their value.
NOT_FEATURES = {"path", "is_gguf", "architecture", "model_type", "num_layers", "hidden_size", "intermediate_size",
                "num_heads", "vocab_size", "max_position_embeddings", "max_model_len", "dtype", "quantization",
                "rms_norm_eps", "bos_token_id", "eos_token_ids", "pad_token_id"}

# Three requests batched, prompts of 5, 19 and 3 tokens then single tokens to 24, 40 and 9
# (40 tokens exceed the sliding window of 12 several times).
LENGTHS, PROMPT_LENS = [24, 40, 9], [5, 19, 3]
UNIT_ROUNDOFF = 2.0 ** -24


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """(family, config changes) -> the config, both paths' logits, the fast path's step count
    and transformers' float32 and float64 logits."""
    cache = {}

    def get(family: str, changes: dict):
        key = (family, tuple(sorted(changes.items())))
        if key not in cache:
            cache[key] = _run_both_paths(family, changes, tmp_path_factory.mktemp(family))
        return cache[key]
    return get


def _save_model(family: str, changes: dict, path) -> str:
    """The tiny model of `family` with `changes` to its config, random weights, float32."""
    torch.manual_seed(0)
    if family in GATED_DELTANET_FAMILIES:
        config = tiny_gated_deltanet_config(family, VOCAB)
    elif family == "granitemoehybrid":
        config = tiny_granite_hybrid_config(VOCAB, experts=False)
    else:
        config = tiny_hf_config(family)
    for name, value in changes.items():
        setattr(config, name, value)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval().save_pretrained(str(path))
    return str(path)


def _run_both_paths(family: str, changes: dict, path) -> dict:
    path = _save_model(family, changes, path)
    config = ModelConfig.from_path(path)
    generator = torch.Generator().manual_seed(3)
    sequences = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(LENGTHS)}
    prompt_lens = dict(zip(sequences, PROMPT_LENS))
    hybrid = family in HYBRID_FAMILIES
    runner, chunk = (HybridRunner, 1) if hybrid else (PagedRunner, 2)
    per_op_model = load_model(config)
    per_op_model._native = None  # decided: this model never takes the native call
    per_op = run_teacher_forced(runner(per_op_model, block_size=4), sequences, prompt_lens, chunk=chunk)
    with pytest.MonkeyPatch.context() as patch:
        native_steps = count_native_steps(patch)
        fast = run_teacher_forced(runner(load_model(config), block_size=4), sequences, prompt_lens, chunk=chunk)
    hf = load_hf(path)
    reference32, reference64 = {}, {}
    with torch.inference_mode():
        for req_id, tokens in sequences.items():
            ids = torch.tensor([tokens])
            reference32[req_id] = hf(ids).logits[0, prompt_lens[req_id] - 1:].double()
        hf = hf.double()
        for req_id, tokens in sequences.items():
            reference64[req_id] = hf(torch.tensor([tokens])).logits[0, prompt_lens[req_id] - 1:]
    num_steps = max(-(-p // chunk) + n - p for p, n in zip(PROMPT_LENS, LENGTHS))
    return dict(config=config, per_op=per_op, fast=fast, native_steps=native_steps[0], num_steps=num_steps,
                reference32=reference32, reference64=reference64)


def _largest_error(logits: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((logits[r].double() - reference[r]).abs().max().item() for r in reference)


def _bound(outcome: dict) -> float:
    """How far a float32 evaluation of the model may be from the float64 truth here.

    transformers in float32 is an independent float32 evaluation of the same sums; its
    largest deviation E from the float64 truth, over every logit of every row, is what
    float32 rounding does on this model and these tokens (a sum of K terms in float32
    errs by up to (K - 1) 2**-24 of the sum of their magnitudes; the model's layers
    amplify that, which only running it tells). Each of our paths adds the same terms in
    other orders (blocked kernels, another thread split), a draw of the same kind of
    error: the largest of ~2,000 errors of equal spread varies by well under 2x from one
    draw to another, and an order whose error constant is twice the reference's (one
    more level of partial sums) doubles it again, so each path stays within 4 E. The
    floor, 64 roundings of the largest logit, keeps the bound above zero where E is
    tiny. Nothing here depends on the CPU: E is measured on the machine that runs."""
    scale = max(ref.abs().max().item() for ref in outcome["reference64"].values())
    return 4 * _largest_error(outcome["reference32"], outcome["reference64"]) + 64 * UNIT_ROUNDOFF * scale


@pytest.mark.parametrize("feature", sorted(FEATURES) + sorted(DECLINED_FEATURES))
def test_both_model_paths_compute_each_feature(outcomes, feature):
    family, changes, has_feature = FEATURES.get(feature) or DECLINED_FEATURES[feature]
    outcome = outcomes(family, changes)
    assert has_feature(outcome["config"]), f"the tiny {family} model does not have {feature}"
    # Every decode step and every 2-token prompt chunk (1-token on hybrids) runs natively (3
    # requests x 2 <= 8 tokens), or none where the native decoder declines the model.
    assert outcome["native_steps"] == (0 if feature in DECLINED_FEATURES else outcome["num_steps"])
    bound = _bound(outcome)
    assert _largest_error(outcome["per_op"], outcome["reference64"]) <= bound
    assert _largest_error(outcome["fast"], outcome["reference64"]) <= bound


def test_every_model_config_field_is_a_row_or_not_a_feature():
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    assert fields - FEATURE_FIELDS - NOT_FEATURES - HYBRID_FIELDS == set(), "a new ModelConfig field: add its FEATURES row"
    assert FEATURE_FIELDS | NOT_FEATURES | HYBRID_FIELDS <= fields
