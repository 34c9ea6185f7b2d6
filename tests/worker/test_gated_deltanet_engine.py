"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE tiny hybrids (Gated DeltaNet state groups + full attention) through
the real scheduler, KV manager, ModelRunner and model: greedy tokens equal transformers'
`generate` in float32 with chunked prefill, prefix-cache hits restoring states, preemption
and async scheduling, and a three-turn chat gives the same tokens with prefix caching on
and off. Qwen3.5's decode steps run through the native decoder (its Gated DeltaNet layers
in the one native call; its teacher-forced logits against the per-op path:
tests/model/test_native_hybrid_decoder.py); the mixture-of-experts models' keep the per-op path.

Our logits stay within 5e-4 of transformers' scale (derived in
tests/model/test_gated_deltanet_models.py); only prompts whose greedy run under transformers
has every top-2 gap, and every routing decision, above twice that are compared, so a
rounding difference cannot flip a token. The fixture draws enough prompts to keep several.
"""
import pytest
import torch
import transformers

from engine_helpers import assert_pool_whole, greedy_params, make_engine, run_to_completion
from helpers.tiny_models import (GATED_DELTANET_FAMILIES, min_router_margin, random_token_prompts,
                                 tiny_gated_deltanet_config)
from helpers.native_steps import count_native_steps
from helpers.toy_recurrent import state_group_hit_blocks
from tiny_models import load_reference, reference_greedy

VOCAB = 256
MAX_TOKENS = 8
MARGIN = 2 * 5e-4


@torch.inference_mode()
def _clear_of_ties(reference, prompt: list[int], tokens: list[int]) -> bool:
    logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]) / logits.abs().amax(-1).clamp(min=1.0)
    routed = getattr(reference.config, "num_experts", 0) and min_router_margin(reference, prompt + tokens) <= MARGIN
    return bool(gaps.min() > MARGIN) and not routed


def _kept(reference, candidates: list[list[int]], limit: int) -> list[tuple[list[int], list[int]]]:
    """Up to `limit` (prompt, transformers' greedy tokens) of the candidates clear of ties."""
    kept = []
    for prompt in candidates:
        if len(kept) == limit:
            break
        tokens = reference_greedy(reference, [prompt], MAX_TOKENS)[0]
        if _clear_of_ties(reference, prompt, tokens):
            kept.append((prompt, tokens))
    return kept


@pytest.fixture(scope="module", params=GATED_DELTANET_FAMILIES)
def model_and_prompts(request, tmp_path_factory):
    """(model directory, transformers model, prompts clear of ties, their greedy tokens, how
    many of them come first and are distinct): up to 4 distinct prompts of 2 to 40 tokens,
    then 2 to 3 sharing a 21-token prefix."""
    torch.manual_seed(1234)
    path = str(tmp_path_factory.mktemp(request.param))
    config = tiny_gated_deltanet_config(request.param, VOCAB)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval().save_pretrained(path)
    reference = load_reference(path)
    if getattr(config, "num_experts", 0):
        reference.set_experts_implementation("eager")
    distinct = _kept(reference, random_token_prompts(VOCAB, 20, 2, 40, seed=1), 4)
    for seed in range(2, 10):
        prefix = random_token_prompts(VOCAB, 1, 21, 21, seed=seed)[0]
        shared = _kept(reference, random_token_prompts(VOCAB, 6, 1, 9, seed=seed, shared_prefix=prefix), 3)
        if len(shared) >= 2:
            break
    assert len(distinct) >= 3 and len(shared) >= 2, "too few prompts clear of ties"
    pairs = distinct + shared
    return path, reference, [p for p, _ in pairs], [t for _, t in pairs], len(distinct)


def _bytes_per_block(config, block_size: int = 4) -> int:
    """What one block id costs (float32): a K/V page of each full-attention layer and a state
    slot (conv inputs and delta-rule state) of each Gated DeltaNet layer."""
    kinds = config.layer_types
    kv_page = 2 * block_size * config.num_key_value_heads * config.head_dim
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim \
        + config.linear_num_value_heads * config.linear_value_head_dim
    state = (config.linear_conv_kernel_dim - 1) * conv_dim \
        + config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return 4 * (kinds.count("full_attention") * kv_page + kinds.count("linear_attention") * state)


def _assert_native_decode(reference, native_steps: list[int]) -> None:
    """Decode steps went through the native decoder where it covers the model (dense MLPs)."""
    if getattr(reference.config, "num_experts", 0):
        assert native_steps[0] == 0
    else:
        assert native_steps[0] > 0


def _check(core, prompts, expected, first_id: int = 0):
    outputs = run_to_completion(core, prompts, greedy_params(MAX_TOKENS), first_id=first_id)
    assert [outputs[str(first_id + i)] for i in range(len(prompts))] == expected
    assert_pool_whole(core)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_hybrid_engine_matches_transformers_with_state_prefix_hits(model_and_prompts, async_scheduling, monkeypatch):
    """A mixed batch in chunks of at most 16 tokens; the shared-prefix prompts, sent after the
    first of them finished, restore its state snapshots from the prefix cache."""
    path, reference, prompts, expected, num_distinct = model_and_prompts
    native_steps = count_native_steps(monkeypatch)
    core = make_engine(path, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    try:
        first_batch = num_distinct + 1  # the distinct prompts and the first with the shared prefix
        _check(core, prompts[:first_batch], expected[:first_batch])
        _check(core, prompts[first_batch:], expected[first_batch:], first_id=first_batch)
        assert core.get_stats().prefix_cache_hits > 0
        assert state_group_hit_blocks(core)[0] > 0
        assert core.executor.max_tokens_per_step <= 16
        _assert_native_decode(reference, native_steps)
    finally:
        core.shutdown()


def test_hybrid_engine_preemption_matches_transformers(model_and_prompts, monkeypatch):
    """A pool of 26 blocks of 4 tokens, too small for every request at once (up to 48 tokens
    each), under async scheduling: victims drop their states and recompute them (from zeros
    or a cached snapshot)."""
    path, reference, prompts, expected, _ = model_and_prompts
    native_steps = count_native_steps(monkeypatch)
    core = make_engine(path, kv_cache_memory=26 * _bytes_per_block(reference.config), async_scheduling=True)
    try:
        _check(core, prompts, expected)
        assert core.get_stats().num_preemptions > 0
        _assert_native_decode(reference, native_steps)
    finally:
        core.shutdown()


def _chat_clear_of_ties(reference, first: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Three chat messages starting with `first` whose every turn (the previous prompt, its
    answer and the next message) is clear of ties under transformers, and its answers: the
    first of a few drawn follow-ups."""
    for seed in range(7, 27):
        messages = [first] + random_token_prompts(VOCAB, 2, 9, 13, seed=seed)
        history, answers = [], []
        for message in messages:
            prompt = history + message
            answers.append(reference_greedy(reference, [prompt], MAX_TOKENS)[0])
            if not _clear_of_ties(reference, prompt, answers[-1]):
                break
            history = prompt + answers[-1]
        else:
            return messages, answers
    raise AssertionError("no three-turn chat clear of ties")


def test_three_turn_chat_same_tokens_with_prefix_caching_on_and_off(model_and_prompts):
    """Each turn's prompt is the previous prompt, its answer and a new message (a chat whose
    turns are all clear of ties under transformers). With caching on, turns 2 and 3 restore
    states from snapshots (hits on the state group); with it off none. Both give
    transformers' greedy answers, so the same ones."""
    path, reference, prompts, _, _ = model_and_prompts
    messages, expected = _chat_clear_of_ties(reference, prompts[0])
    for caching in (True, False):
        core = make_engine(path, enable_prefix_caching=caching, max_num_batched_tokens=16)
        try:
            history, answers = [], []
            for turn, message in enumerate(messages):
                prompt = history + message
                answer = run_to_completion(core, [prompt], greedy_params(MAX_TOKENS), first_id=turn)[str(turn)]
                answers.append(answer)
                history = prompt + answer
            assert answers == expected
            assert_pool_whole(core)
            hits, prefix_hits = state_group_hit_blocks(core), core.get_stats().prefix_cache_hits
        finally:
            core.shutdown()
        if caching:
            assert hits[0] >= 2 and prefix_hits > 0
        else:
            assert hits == [0] and prefix_hits == 0
