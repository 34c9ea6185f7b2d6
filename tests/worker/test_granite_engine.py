"""Granite 4 hybrids (Mamba-2 + attention, tests/helpers/tiny_models.py) through the real
scheduler, KV manager (a full-attention group and a state group), ModelRunner and model:
greedy tokens equal transformers' `generate` in float32 with chunked prefill, prefix hits on
the state group, preemption and async scheduling. Without routed experts the decode steps run
through the native decoder (Mamba-2 layers in the one native call; its teacher-forced logits
against the per-op path: tests/model/test_native_hybrid_decoder.py); with them, the per-op path.

Only prompts whose every greedy choice (and, with routed experts, every routing decision)
clears twice the derived bound (`GRANITE_HYBRID_BOUND`) are compared: within it two correct
float32 implementations may break a tie either way."""
import pytest
import torch
import transformers

from engine_helpers import assert_pool_whole, greedy_params, make_engine, run_to_completion
from helpers.native_steps import count_native_steps
from helpers.tiny_models import (GRANITE_HYBRID_BOUND, min_router_margin, random_token_prompts,
                                 tiny_granite_hybrid_config)
from helpers.toy_recurrent import state_group_hit_blocks
from tiny_models import load_reference

VOCAB = 256
MAX_TOKENS = 8
MARGIN = 2 * GRANITE_HYBRID_BOUND


@torch.inference_mode()
def _greedy_clear_of_ties(reference, prompt: list[int], experts: bool) -> list[int] | None:
    """transformers' greedy tokens after `prompt`, or None where a choice or a routing decision
    lies within `MARGIN` of a tie."""
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    for row in out.logits:
        top = row[0].float().topk(2).values
        if (top[0] - top[1]).item() <= MARGIN * max(1.0, row[0].abs().max().item()):
            return None
    tokens = out.sequences[0, len(prompt):].tolist()
    if experts and min_router_margin(reference, prompt + tokens) <= MARGIN:
        return None
    return tokens


def _clear_prompts(reference, candidates: list[list[int]], limit: int, experts: bool):
    """Up to `limit` (prompt, transformers' greedy tokens) of the candidates clear of ties."""
    kept = []
    for prompt in candidates:
        if len(kept) == limit:
            break
        tokens = _greedy_clear_of_ties(reference, prompt, experts)
        if tokens is not None:
            kept.append((prompt, tokens))
    return kept


def _model_and_prompts(tmp_path_factory, experts: bool):
    """(model directory, prompts clear of ties, transformers' greedy tokens): up to 5 distinct
    prompts and 2 to 3 sharing a 23-token prefix."""
    torch.manual_seed(1234)
    path = str(tmp_path_factory.mktemp("moe" if experts else "dense"))
    transformers.AutoModelForCausalLM.from_config(tiny_granite_hybrid_config(VOCAB, experts=experts),
                                                  attn_implementation="eager").eval().save_pretrained(path)
    reference = load_reference(path)
    if experts:
        reference.set_experts_implementation("eager")  # experts one by one, in our order
    distinct = _clear_prompts(reference, random_token_prompts(VOCAB, 10, 2, 30, seed=1), 5, experts)
    for seed in range(2, 6):
        prefix = random_token_prompts(VOCAB, 1, 23, 23, seed=seed)[0]
        shared = _clear_prompts(reference, random_token_prompts(VOCAB, 5, 1, 9, seed=seed, shared_prefix=prefix),
                                3, experts)
        if len(shared) >= 2:
            break
    assert len(distinct) >= 3 and len(shared) >= 2, "too few prompts clear of ties"
    pairs = distinct + shared
    return path, [p for p, _ in pairs], [t for _, t in pairs]


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    return _model_and_prompts(tmp_path_factory, experts=False)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return _model_and_prompts(tmp_path_factory, experts=True)


def _check(core, prompts, expected):
    outputs = run_to_completion(core, prompts, greedy_params(MAX_TOKENS))
    assert [outputs[str(i)] for i in range(len(prompts))] == expected
    assert_pool_whole(core)


# The engine's path is the same with routed experts or without (the MoE block is a layer's MLP;
# tests/model/test_granite_hybrid.py runs both against transformers): the variant with routed
# experts, whose reference costs the most, runs once.
@pytest.mark.parametrize("variant,async_scheduling", [("dense", True), ("dense", False), ("moe", True)])
def test_granite_engine_matches_transformers_with_prefix_hits(request, variant, async_scheduling, monkeypatch):
    """A mixed batch in chunks of at most 16 tokens over blocks of 4; the shared-prefix prompts
    hit the cache, the state group restoring a snapshot."""
    path, prompts, expected = request.getfixturevalue(f"{variant}_model")
    native_steps = count_native_steps(monkeypatch)
    core = make_engine(path, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    try:
        _check(core, prompts, expected)
        assert max(out.total_num_scheduled_tokens for out in core.executor.scheduler_outputs) <= 16
        assert core.get_stats().prefix_cache_hits > 0
        assert sum(state_group_hit_blocks(core)) > 0
        assert (native_steps[0] > 0) == (variant == "dense")
    finally:
        core.shutdown()


def test_granite_engine_preemption_matches_transformers(dense_model, monkeypatch):
    """A pool of 24 blocks (each an attention page and a page of each state layer) for up to 8
    requests of up to 40 tokens, no prefix caching: requests are preempted, drop their state and
    recompute it from zeros, under async scheduling."""
    path, prompts, expected = dense_model
    native_steps = count_native_steps(monkeypatch)
    core = make_engine(path, kv_cache_memory="800KiB", async_scheduling=True, enable_prefix_caching=False)
    try:
        _check(core, prompts, expected)
        assert core.get_stats().num_preemptions > 0
        assert native_steps[0] > 0
    finally:
        core.shutdown()


def test_three_turn_chat_same_tokens_with_prefix_caching_on_and_off(dense_model):
    """A 3-turn chat (each prompt: the previous prompt, its answer and a new user message) gives
    transformers' greedy answers with prefix caching on and off; with it on, turns 2 and 3
    restore the state group from snapshots of the earlier turns. Every answer is checked clear of
    ties (a near-tie could go either way between two float32 paths)."""
    path, _, _ = dense_model
    reference = load_reference(path)
    turns = random_token_prompts(VOCAB, 3, 11, 29, seed=7)
    answers_by_setting = {}
    for caching in (True, False):
        core = make_engine(path, enable_prefix_caching=caching, max_num_batched_tokens=16)
        try:
            history, answers = [], []
            for turn, user in enumerate(turns):
                prompt = history + user
                answer = run_to_completion(core, [prompt], greedy_params(MAX_TOKENS), first_id=turn)[str(turn)]
                assert answer == _greedy_clear_of_ties(reference, prompt, experts=False), (caching, turn)
                answers.append(answer)
                history = prompt + answer
            hit_blocks = state_group_hit_blocks(core)
            assert_pool_whole(core)
        finally:
            core.shutdown()
        answers_by_setting[caching] = answers
        assert (sum(hit_blocks) >= 2) if caching else hit_blocks == [0], (caching, hit_blocks)
    assert answers_by_setting[True] == answers_by_setting[False]
