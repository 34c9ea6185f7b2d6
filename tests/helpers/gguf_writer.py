"""Tiny transformers models written as GGUF files the way llama.cpp's converter
writes them, for the GGUF loading tests (needs the `gguf` package)."""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (interleaves the rotary halves per head)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
               "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
# Gemma's sandwich norms under llama.cpp's names.
_GEMMA_GGUF_NAMES = {**_GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
                     "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


# transformers model_type -> llama.cpp architecture (Mixtral is "llama" with experts).
_GGUF_ARCHS = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def _gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    names = _GEMMA_GGUF_NAMES if arch == "gemma2" else _GGUF_NAMES
    parts = hf_name.split(".")  # model.layers.N.<module...>.weight|bias
    return f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"


def _stacked_experts(state: dict) -> dict:
    """transformers 5 holds a layer's experts as gate_up [E, 2I, hidden] and down [E, hidden, I];
    llama.cpp stores gate, up and down as separate 3-D stacks (named here as the HF-style
    `mlp.experts.{gate,up,down}_proj.weight` that `_gguf_name` maps)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def _write_metadata(writer, cfg, arch: str) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if getattr(cfg, "num_experts_per_tok", None):
        writer.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if hasattr(cfg, "norm_topk_prob"):
            writer.add_expert_weights_norm(cfg.norm_topk_prob)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)


def write_gguf(hf_model, path: str, qtype: QType, tokenizer_model: str | None = None) -> None:
    """Write a transformers model as llama.cpp's converter would; matrices stored as `qtype`.

    llama.cpp conventions reproduced here: Llama (and Mixtral) Q/K rows permuted, Gemma norm
    weights stored as (1 + w), tied output matrix omitted, experts stacked into 3-D tensors,
    routers in float32. `tokenizer_model`
    "no_vocab" lets llama.cpp itself load the file (token ids only, no text)."""
    cfg = hf_model.config
    arch = _GGUF_ARCHS.get(cfg.model_type, cfg.model_type)
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, cfg, arch)
    if tokenizer_model is not None:
        writer.add_tokenizer_model(tokenizer_model)
    for name, tensor in _stacked_experts(hf_model.state_dict()).items():
        if "rotary" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        array = tensor.float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        if arch == "gemma2" and "norm" in name:
            array = array + 1.0
        if array.ndim == 1 or qtype == QType.F32 or name.endswith("mlp.gate.weight"):  # routers stay float
            writer.add_tensor(_gguf_name(name, arch), array)
        else:
            writer.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
