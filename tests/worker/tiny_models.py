"""Tiny random-weight models saved with transformers, and transformers' greedy outputs.

Weights use a large init range and untied LM heads so that greedy outputs vary
(tied tiny models mostly repeat the input token) and the logits of a tiny model
are well separated.
"""
from __future__ import annotations

from functools import partial

import torch
import transformers
from helpers.tiny_models import random_token_prompts, tiny_gemma2_config, tiny_llama_config

VOCAB_SIZE = 256


CONFIGS = {"llama": partial(tiny_llama_config, VOCAB_SIZE),
           "gemma2": partial(tiny_gemma2_config, VOCAB_SIZE, tie_word_embeddings=False)}


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


random_prompts = partial(random_token_prompts, VOCAB_SIZE)


def chi_square_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """Chi-square p-value of token samples against the distribution `probs` (tokens
    expected fewer than 5 times pooled into one cell)."""
    from scipy.stats import chisquare

    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB_SIZE).double()
    expected = probs.double() / probs.double().sum() * len(samples)
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    expected = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)
