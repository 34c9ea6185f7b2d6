"""Tiny random-weight models saved with transformers, and transformers' greedy outputs.

Weights use a large init range and untied LM heads so that greedy outputs vary
(tied tiny models mostly repeat the input token) and the logits of a tiny model
are well separated.
"""
from __future__ import annotations

import random

import torch
import transformers

VOCAB_SIZE = 256


def _llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=12, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False)


CONFIGS = {"llama": _llama_config, "gemma2": _gemma2_config}


def save_tiny_model(kind: str, path) -> str:
    """Create a random model of the given kind, save it (float32) and return the directory."""
    torch.manual_seed(1234)
    config = CONFIGS[kind]()
    config._attn_implementation = "eager"
    model_class = {"llama": transformers.LlamaForCausalLM, "gemma2": transformers.Gemma2ForCausalLM}[kind]
    model = model_class(config).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def load_reference(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def reference_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding involved)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def random_prompts(num_prompts: int, min_len: int, max_len: int, seed: int = 0,
                   shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = list(shared_prefix or [])
    return [prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]
