"""Tiny random models for the tensor-parallel tests, and an engine driver.

TP=2 adds the ranks' partial o_proj/down_proj sums in another float order than
TP=1, so its greedy tokens are checked under transformers (tests/helpers/greedy_check.py,
a near-tie may break either way) and its logprobs against TP=1's on the same tokens.
"""
from __future__ import annotations

from functools import partial

import torch
import transformers
from helpers.tiny_models import random_token_prompts, tiny_gemma2_config, tiny_llama_config

from kvserve.engine.core import EngineCore, EngineCoreRequest
from kvserve.sampling_params import SamplingParams
from kvserve.engine.create_config import create_engine_config

VOCAB_SIZE = 250  # not a multiple of 4: the vocabulary shards are padded


MODELS = {
    "llama_gqa": (partial(tiny_llama_config, VOCAB_SIZE, num_kv_heads=2), transformers.LlamaForCausalLM),
    "llama_mqa": (partial(tiny_llama_config, VOCAB_SIZE, num_kv_heads=1), transformers.LlamaForCausalLM),
    "gemma2": (partial(tiny_gemma2_config, VOCAB_SIZE, tie_word_embeddings=True),
               transformers.Gemma2ForCausalLM),
}


def save_tiny_model(kind: str, path) -> str:
    """Save a random float32 model of `kind` with transformers; return its directory."""
    torch.manual_seed(4321)
    make_config, model_class = MODELS[kind]
    model_class(make_config()).eval().save_pretrained(str(path), safe_serialization=True)
    return str(path)


def make_engine(model_path: str, tensor_parallel_size: int, **overrides) -> EngineCore:
    kwargs = dict(kv_cache_memory="8MiB", block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                  device="cpu", async_scheduling=True, tensor_parallel_size=tensor_parallel_size)
    kwargs.update(overrides)
    return EngineCore(create_engine_config(model=model_path, **kwargs))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


random_prompts = partial(random_token_prompts, VOCAB_SIZE)


def run_requests(core: EngineCore, prompts: list[list[int]], params, first_id: int = 0,
                 max_steps: int = 5_000) -> dict[str, list[int]]:
    """Add the prompts as requests and step until all finish; output tokens by request id."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    tokens: dict[str, list[int]] = {}
    for i, (prompt, sampling_params) in enumerate(zip(prompts, params_list)):
        tokens[str(first_id + i)] = []
        core.add_request(EngineCoreRequest(str(first_id + i), prompt, sampling_params))
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return tokens
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
    raise AssertionError(f"requests unfinished after {max_steps} steps")


def save_tiny_chat_model(path) -> str:
    """A tiny random Llama (one KV head, so replicated at TP=2) that carries the default
    model's tokenizer and chat template, for tests through the text front-ends."""
    from kvserve.engine.model_path import default_model_path
    from kvserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    torch.manual_seed(4321)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def is_running(pid: int) -> bool:
    """Alive and not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
