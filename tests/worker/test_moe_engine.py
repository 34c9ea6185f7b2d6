"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) through the real scheduler,
ModelRunner and model: greedy tokens equal transformers' `generate` in float32 with
prefix-cache hits, preemption and async scheduling.

A routing decision within rounding of a tie may go either way in two float32
implementations (tests/model/test_moe.py derives the bound, relative 1.5e-4), so only
prompts whose every decision, over prompt and continuation, clears twice that are
compared; the fixture draws enough that each test keeps several.
"""
import pytest
import torch
import transformers

from engine_helpers import assert_pool_whole, greedy_params, make_engine, run_to_completion
from helpers.tiny_models import MOE_FAMILIES, min_router_margin, random_token_prompts, tiny_moe_config
from tiny_models import load_reference, reference_greedy

VOCAB = 256
MAX_TOKENS = 8
MARGIN = 2 * 1.5e-4


def _config(family: str):
    """The family's tiny config; Mixtral's without its sliding window, which frees blocks as
    requests grow (no preemption); tests/model/test_moe.py runs it windowed."""
    return tiny_moe_config(family, VOCAB, window=None)


def _clear_of_ties(reference, candidates: list[list[int]], limit: int) -> list[tuple[list[int], list[int]]]:
    """Up to `limit` (prompt, transformers' greedy tokens) of the candidates whose routing
    decisions all clear `MARGIN`."""
    kept = []
    for prompt, tokens in zip(candidates, reference_greedy(reference, candidates, MAX_TOKENS)):
        if len(kept) < limit and min_router_margin(reference, prompt + tokens) > MARGIN:
            kept.append((prompt, tokens))
    return kept


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def model_and_prompts(request, tmp_path_factory):
    """(family, model directory, prompts clear of routing ties, transformers' greedy tokens):
    up to 5 distinct prompts and 2 to 3 sharing a 23-token prefix (the first of a few drawn
    prefixes that is itself clear of ties)."""
    torch.manual_seed(1234)
    path = str(tmp_path_factory.mktemp(request.param))
    transformers.AutoModelForCausalLM.from_config(_config(request.param),
                                                  attn_implementation="eager").eval().save_pretrained(path)
    reference = load_reference(path)
    reference.set_experts_implementation("eager")  # experts one by one, in our order
    distinct = _clear_of_ties(reference, random_token_prompts(VOCAB, 10, 2, 30, seed=1), 5)
    for seed in range(2, 6):
        prefix = random_token_prompts(VOCAB, 1, 23, 23, seed=seed)[0]
        shared = _clear_of_ties(reference, random_token_prompts(VOCAB, 5, 1, 9, seed=seed, shared_prefix=prefix), 3)
        if len(shared) >= 2:
            break
    assert len(distinct) >= 3 and len(shared) >= 2, "too few prompts clear of routing ties"
    prompts = [p for p, _ in distinct + shared]
    return request.param, path, prompts, [t for _, t in distinct + shared]


def _check(core, prompts, expected):
    outputs = run_to_completion(core, prompts, greedy_params(MAX_TOKENS))
    assert [outputs[str(i)] for i in range(len(prompts))] == expected
    assert_pool_whole(core)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_moe_engine_matches_transformers_with_prefix_hits(model_and_prompts, async_scheduling):
    """A mixed batch in chunks of at most 16 tokens; the shared-prefix prompts hit the cache."""
    _, path, prompts, expected = model_and_prompts
    core = make_engine(path, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    try:
        _check(core, prompts, expected)
        assert core.get_stats().prefix_cache_hits > 0
    finally:
        core.shutdown()


def test_moe_engine_preemption_matches_transformers(model_and_prompts):
    """A KV pool of 20 blocks of 4 tokens for up to 8 requests of up to 40 tokens: requests
    are preempted and recomputed, under async scheduling."""
    family, path, prompts, expected = model_and_prompts
    hf_config = _config(family)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    bytes_per_block = hf_config.num_hidden_layers * 2 * hf_config.num_key_value_heads * head_dim * 4 * 4
    core = make_engine(path, kv_cache_memory=20 * bytes_per_block, async_scheduling=True)
    try:
        _check(core, prompts, expected)
        assert core.get_stats().num_preemptions > 0
    finally:
        core.shutdown()
