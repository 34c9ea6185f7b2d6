"""The recurrent-state KV group end to end: EngineCore (scheduler, KV manager, runner)
over the test-only toy hybrid model (toy recurrent + full + sliding layers: three KV
groups), checked teacher forced against the toy's whole-sequence reference
(`helpers.toy_recurrent`), with prefix caching, chunked prefill, preemption and async
scheduling."""
import logging

import pytest
import torch
from helpers.greedy_check import GREEDY_SLACK, assert_greedy_continuations
from helpers.toy_recurrent import (VOCAB_SIZE, ToyReference, build_toy_model, make_toy_engine, reference_logits,
                                   state_group_hit_blocks, toy_model_config)

from kvserve.kv_cache.interface import StateSpec

from engine_helpers import RecordingExecutor, assert_pool_whole, greedy_params, run_to_completion



@pytest.fixture(scope="module")
def reference():
    return ToyReference(build_toy_model(toy_model_config()))


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def _run(core, prompts, max_tokens: int, first_id: int = 0) -> list[list[int]]:
    tokens = run_to_completion(core, prompts, greedy_params(max_tokens), first_id=first_id)
    return [tokens[str(first_id + i)] for i in range(len(prompts))]


def test_the_budget_is_split_between_an_attention_pool_and_a_state_pool(monkeypatch, reference, caplog):
    """#29: the toy hybrid's state groups get a pool of their own, sized for 8 running requests and
    steps of 256 tokens (blocks of 4, caching on): 2 * (3 * 8 + 2 * 256 // 4) + 1 = 305 slots; the
    state layers' tensors have that many slots, the attention layers' the rest of the 1 MiB; the
    start-up log says how the budget is split; and the engine runs greedy under its reference."""
    with caplog.at_level(logging.INFO, logger="kvserve.engine.core"):
        core = make_toy_engine(monkeypatch, RecordingExecutor)
    try:
        config = core.kv_cache_config
        assert config.num_state_blocks == 305
        runner = core.executor.model_runner
        specs = runner.get_kv_cache_specs()
        state_bytes = sum(spec.page_size_bytes for spec in specs.values() if isinstance(spec, StateSpec))
        # Each attention tensor holds num_blocks pages: their sum over num_blocks is one block id's cost.
        attention_bytes = sum(t.size for t in config.kv_cache_tensors) - 305 * state_bytes
        assert attention_bytes % config.num_blocks == 0
        assert config.num_blocks == ((1 << 20) - 305 * state_bytes) // (attention_bytes // config.num_blocks)
        for name, cache in runner.kv_caches.items():
            pages = cache[0].shape[0] if isinstance(cache, tuple) else cache.shape[2]
            assert pages == (305 if isinstance(cache, tuple) else config.num_blocks), name
        assert (f"attention pool {config.num_blocks} blocks" in caplog.text
                and "state pool 305 blocks" in caplog.text), caplog.text
        prompts = _prompts([5, 17, 26])
        outputs = _run(core, prompts, max_tokens=6)
        assert_greedy_continuations(reference, prompts, outputs, num_tokens=6)
        assert_pool_whole(core)
    finally:
        core.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_toy_hybrid_is_greedy_under_its_reference(monkeypatch, reference, async_scheduling, enable_prefix_caching):
    prompts = _prompts([3, 9, 16, 23, 30])
    core = make_toy_engine(monkeypatch, RecordingExecutor, async_scheduling=async_scheduling,
                           enable_prefix_caching=enable_prefix_caching)
    try:
        outputs = _run(core, prompts, max_tokens=10)
        assert_greedy_continuations(reference, prompts, outputs, num_tokens=10)
        assert_pool_whole(core)
    finally:
        core.shutdown()


def test_chunked_prefill_hands_the_state_over_between_chunks(monkeypatch, reference):
    """Prompts of 41-57 tokens in chunks of at most 12 (block size 8): every chunk starts
    from the state the previous one wrote, and snapshots land mid-chunk. (With blocks of 8
    a state slot is not the size of a K/V row of the attention layers: a state tensor
    sharing their buffer would overlap other blocks' K/V, as it once did.)"""
    prompts = _prompts([41, 50, 57], seed=1)
    core = make_toy_engine(monkeypatch, RecordingExecutor, max_num_batched_tokens=12, block_size=8)
    try:
        outputs = _run(core, prompts, max_tokens=6)
        assert max(out.total_num_scheduled_tokens for out in core.executor.scheduler_outputs) <= 12
        assert_greedy_continuations(reference, prompts, outputs, num_tokens=6)
        assert_pool_whole(core)
    finally:
        core.shutdown()


def test_preempted_requests_recompute_their_state(monkeypatch, reference):
    """A pool too small for all requests at once: victims drop their state and
    recompute it (from zeros or a cached snapshot), never reusing a partial one."""
    prompts = _prompts([12, 14, 10, 13, 11, 12], seed=2)
    # 42 blocks of 1 KiB: an attention page (512 B) and the two state layers' pages (256 B each).
    core = make_toy_engine(monkeypatch, RecordingExecutor, num_blocks_memory=42 * 1024)
    try:
        outputs = _run(core, prompts, max_tokens=30)
        assert core.scheduler.num_preemptions > 0
        assert_greedy_continuations(reference, prompts, outputs, num_tokens=30)
        assert_pool_whole(core)
    finally:
        core.shutdown()


def _chat(core, turns: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Three chat turns: each prompt is the previous prompt, its answer and the next user
    message. Returns the prompts and the answers."""
    prompts, answers, history = [], [], []
    for turn, user in enumerate(turns):
        prompt = history + user
        (answer,) = _run(core, [prompt], max_tokens, first_id=turn)
        prompts.append(prompt)
        answers.append(answer)
        history = prompt + answer
    return prompts, answers


def _first_near_tie(reference, prompt: list[int], tokens: list[int]) -> int:
    """Index of the first answer token whose reference top-2 logits are within the
    greedy slack (where two correct engines may part ways); len(tokens) if none."""
    logits = reference_logits(reference.model, prompt + tokens)[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    top2 = logits.topk(2, dim=-1).values
    near = ((top2[:, 0] - top2[:, 1]) / logits.abs().max().clamp(min=1.0)) <= GREEDY_SLACK
    return int(near.nonzero()[0]) if near.any() else len(tokens)


def test_three_turn_chat_same_tokens_with_prefix_caching_on_and_off(monkeypatch, reference):
    turns = _prompts([29, 11, 13], seed=3)
    results = {}
    for caching in (True, False):
        core = make_toy_engine(monkeypatch, RecordingExecutor, enable_prefix_caching=caching)
        try:
            results[caching] = _chat(core, turns, max_tokens=7)
            hit_blocks = state_group_hit_blocks(core)
            stats = core.get_stats()
            assert_pool_whole(core)
        finally:
            core.shutdown()
        if caching:
            # Turns 2 and 3 restore both state groups from snapshots of the earlier turns.
            assert len(hit_blocks) == 1 and hit_blocks[0] >= 2, hit_blocks
            assert stats.prefix_cache_hits > 0
        else:
            assert hit_blocks == [0] and stats.prefix_cache_hits == 0
    prompts_on, answers_on = results[True]
    prompts_off, answers_off = results[False]
    assert_greedy_continuations(reference, prompts_on, answers_on, num_tokens=7)
    assert_greedy_continuations(reference, prompts_off, answers_off, num_tokens=7)
    for prompt_on, prompt_off, on, off in zip(prompts_on, prompts_off, answers_on, answers_off):
        if prompt_on != prompt_off:
            break  # an earlier near-tie parted the conversations
        tie = _first_near_tie(reference, prompt_on, on)
        assert on[:tie + 1] == off[:tie + 1] or tie < len(on) and on[:tie] == off[:tie]


def test_speculative_decoding_is_refused_for_state_layers(monkeypatch):
    """A rejected draft would stay in the recurrent state: the engine refuses to start."""
    from kvserve.spec_decode.config import SpeculativeConfig
    with pytest.raises(ValueError, match="speculative decoding is not supported for models with recurrent-state"):
        make_toy_engine(monkeypatch, RecordingExecutor,
                        speculative_config=SpeculativeConfig(num_speculative_tokens=2))
