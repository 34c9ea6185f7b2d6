"""Configs of tiny random-weight transformers models, and random token prompts.

A large init range keeps the logits of such a small model well separated, so
greedy outputs vary and do not tie.
"""
from __future__ import annotations

import random

import torch
import transformers


def tiny_llama_config(vocab_size: int, num_kv_heads: int = 2) -> transformers.LlamaConfig:
    """Two layers, four query heads, untied LM head."""
    return transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_gemma2_config(vocab_size: int, tie_word_embeddings: bool) -> transformers.Gemma2Config:
    """Four layers alternating sliding (window 12) and global attention, both soft-caps on."""
    return transformers.Gemma2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=12, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=tie_word_embeddings)


MOE_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")


def tiny_moe_config(family: str, vocab_size: int, window: int | None = 12):
    """Tiny mixture-of-experts configs: 8 experts of width 32, top-2, hidden 64, head size 16.
    Qwen3-MoE: three layers, the middle one dense (`mlp_only_layers`, width 128), top-k
    renormalized; Mixtral: sliding window `window` (None: none) on every layer; OLMoE: Q/K norm over the
    whole projection, top-k not renormalized; gpt-oss: sliding (`window`) and full layers
    alternating (all full without a window), attention sinks, biased clamped-SwiGLU experts."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, num_experts_per_tok=2,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**common, "intermediate_size": 128}, moe_intermediate_size=32,
                                           num_experts=8, num_hidden_layers=3, head_dim=16, mlp_only_layers=[1],
                                           decoder_sparse_step=1, norm_topk_prob=True)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=8, num_hidden_layers=2, head_dim=16,
                                          sliding_window=window)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=8, num_hidden_layers=2, norm_topk_prob=False)
    if family == "gpt_oss":
        kinds = ["sliding_attention", "full_attention"] if window else ["full_attention"] * 2
        return transformers.GptOssConfig(**common, num_local_experts=8, num_hidden_layers=2, head_dim=16,
                                         sliding_window=window or 512, layer_types=kinds)  # (unused when all full)
    raise ValueError(family)


GATED_DELTANET_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def tiny_gated_deltanet_config(family: str, vocab_size: int):
    """Tiny Qwen3-Next / Qwen3.5 hybrids: 4 layers (3 Gated DeltaNet, then full attention),
    hidden 64; linear attention 2 key heads of 16, 4 value heads of 8 (each key head serves
    two), convolution width 4; gated attention 4 heads / 2 KV heads of 16, a quarter of each
    rotated. Qwen3-Next: 8 experts of width 32, top-2 renormalized, a shared expert of 32,
    layer 1 dense (`mlp_only_layers`, width 96); Qwen3.5: dense (96); Qwen3.5-MoE: like
    Qwen3-Next on every layer."""
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4)
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **experts, intermediate_size=96, mlp_only_layers=[1],
                                            decoder_sparse_step=1, norm_topk_prob=True)
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, intermediate_size=96)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**common, **experts)
    raise ValueError(family)


# The bound on |kvserve's logit - transformers' logit| for `tiny_granite_hybrid_config`, relative
# to the logits' scale (at least 1), both in float32.
# Both run the same float32 operations outside reductions; the reductions may be ordered
# differently: matmuls (blocked by row count), paged attention, and the SSM, which
# transformers scans in chunks of 16 tokens (a prompt) or one token (a step) and we in
# chunks of 64 cut at snapshot points. Reordering a float32 sum of n terms moves it by at most
# gamma_n * sum|terms|, gamma_n ~ n * 2**-24 (Higham 3.1); the widest reduction here has
# n = 128 terms (the output projection), gamma = 7.6e-6. An SSD decay weight exp(S) is
# computed from a sum S of up to 64 log-decays, which float32 sums to a relative error
# gamma_64, so the weight errs by exp(S) |S| gamma_64 <= gamma_64 / e: one more such stage.
# A logit lies at the end of at most 12 reduction stages per layer (in_proj, conv, the
# chunk's sums, C.h, the chunk states, decay weights, the gated norm, out_proj, router,
# expert gate/up and down, shared gate/up and down: counted as 12 of the widest) over 4
# layers plus the LM head: 49 stages. With RMSNorm rescaling every layer's input and sum|terms|
# about the size of the result for these random weights (a large init range), the errors add
# to at most 49 * 7.6e-6 = 3.7e-4 of the logits' scale.
GRANITE_HYBRID_BOUND = 3.7e-4


def tiny_granite_hybrid_config(vocab_size: int, experts: bool = True, rope: bool = False):
    """A tiny Granite 4 hybrid (GraniteMoeHybridForCausalLM): four layers, Mamba-2 (8 heads of
    16 channels, 2 groups, state 16, conv 4; transformers scans prompts in chunks of 16) except
    the second (attention, 4 heads of 16, 2 KV heads); with `experts` 4 routed experts of width
    32 (top 2) beside a shared one of width 48, else the shared MLP alone; attention without
    RoPE unless `rope`; Granite's multipliers on."""
    return transformers.GraniteMoeHybridConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16,  # transformers pads each scan to a whole chunk: 256 would cost it 16x
        num_local_experts=4 if experts else 0, num_experts_per_tok=2,
        position_embedding_type="rope" if rope else "nope", embedding_multiplier=1.5, residual_multiplier=0.7,
        attention_multiplier=0.25, logits_scaling=2.0, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False)


@torch.inference_mode()
def min_router_margin(hf_model, tokens: list[int]) -> float:
    """The smallest gap, over tokens and sparse layers, between the k-th and (k+1)-th largest
    router logit of a transformers MoE model's forward over `tokens`, relative to the router
    logits' scale (at least 1): how far rounding must move them to change a routing decision."""
    captured = []
    blocks = [getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None) for layer in hf_model.model.layers]
    routers = [getattr(block, "gate", None) or getattr(block, "router", None) for block in blocks]
    hooks = [router.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
             for router in routers if router is not None]
    try:
        hf_model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    k = hf_model.config.num_experts_per_tok
    margins = []
    for logits in captured:
        top = logits.float().topk(k + 1, dim=-1).values
        margins.append(((top[:, k - 1] - top[:, k]) / logits.abs().max().clamp(min=1.0)).min().item())
    return min(margins)


def random_token_prompts(vocab_size: int, num_prompts: int, min_len: int, max_len: int, seed: int = 0,
                         shared_prefix: list[int] | None = None) -> list[list[int]]:
    """Prompts of random length in [min_len, max_len] (after `shared_prefix`), ids >= 3
    so that none is a special token."""
    rng = random.Random(seed)
    prefix = list(shared_prefix or [])
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]
