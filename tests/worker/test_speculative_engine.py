"""Speculative decoding through the real engine: greedy outputs identical to the
engine without it (itself checked against transformers in test_runner_vs_transformers).

Prompts repeat segments of themselves so that prompt lookup finds drafts; the
tiny random models accept some of them and reject most, so every step mixes
accepted prefixes, rollbacks and plain decodes. Each run also has a small KV
pool (preemption), a token budget below the prompt lengths (chunked prefill),
a hash unit finer than a block (partial-block CoW hits) and n > 1-style
siblings (the same prompt twice).
"""
from __future__ import annotations

import pytest

from engine_helpers import assert_pool_whole, greedy_params, make_engine, run_checked, run_to_completion
from tiny_models import random_prompts, save_tiny_model
from kvserve.sampling_params import SamplingParams

# Never back off: every step with a match verifies a draft.
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance_rate": 0.0,
        "draft_token_cost": 0.0, "max_misses": 1000,
        "disable_by_batch_size": 64}
SETTINGS = dict(max_num_batched_tokens=40, hash_block_size=2)
# About two requests' worth of KV (gemma2 has twice the layers): preemption.
KV_MEMORY = {"llama": "96KiB", "gemma2": "192KiB"}


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    return {kind: save_tiny_model(kind, tmp_path_factory.mktemp(kind)) for kind in ("llama", "gemma2")}


def _prompts() -> list[list[int]]:
    base = random_prompts(4, 10, 24, seed=3)
    prompts = [p + p[:6] + p for p in base]
    return prompts + [prompts[0]]  # a sibling: same prompt, prefix-cache hit


def _params() -> list[SamplingParams]:
    stop = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[17, 99])
    return [greedy_params(40), greedy_params(33), stop, greedy_params(40, logprobs=2), greedy_params(40)]


def _run(model_paths, kind: str, speculative_config, **overrides):
    path = model_paths[kind]
    overrides.setdefault("kv_cache_memory", KV_MEMORY[kind])
    core = make_engine(path, speculative_config=speculative_config, **{**SETTINGS, **overrides})
    return *run_checked(core, _prompts(), _params()), core


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama", {"async_scheduling": False}),
    ("gemma2", {}),
    ("gemma2", {"sliding_window_kv": "circular", "async_scheduling": False}),
])
def test_greedy_speculation_is_lossless(model_paths, kind, overrides):
    expected, _, _ = _run(model_paths, kind, None, **overrides)
    got, stats, core = _run(model_paths, kind, SPEC, **overrides)
    assert got == expected
    spec = stats.spec_decoding_stats
    assert spec.num_drafts > 10 and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert core.scheduler.num_preemptions > 0
    drafted = [out for out in core.executor.scheduler_outputs if out.scheduled_spec_decode_tokens]
    assert drafted
    if kind == "llama":  # the hybrid model's prefix hits end on whole blocks
        assert core.executor.num_block_copies > 0


def test_greedy_adaptive_speculation_is_lossless(model_paths):
    """With the default cost model drafts vary in length and stop and resume per request."""
    adaptive = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64,
                "backoff_steps": 2}
    expected, _, _ = _run(model_paths, "llama", None)
    got, stats, core = _run(model_paths, "llama", adaptive)
    assert got == expected
    lengths = {len(drafts) for out in core.executor.scheduler_outputs
               for drafts in out.scheduled_spec_decode_tokens.values()}
    assert len(lengths) > 1 and stats.spec_decoding_stats.num_drafts > 5


def test_speculative_steps_carry_logprobs_per_token(model_paths):
    """Each emitted token of a verified draft gets its own logprobs entry."""
    core = make_engine(model_paths["llama"], speculative_config=SPEC, kv_cache_memory="1MiB", **SETTINGS)
    try:
        from kvserve.engine.core import EngineCoreRequest
        core.add_request(EngineCoreRequest("a", _prompts()[0], greedy_params(30, logprobs=1)))
        tokens, logprobs = [], []
        while core.has_unfinished_requests():
            for output in core.step():
                tokens.extend(output.new_token_ids)
                logprobs.extend(output.new_logprobs or [])
        assert [lp.sampled_token_id for lp in logprobs] == tokens
    finally:
        core.shutdown()


SUFFIX_SPEC = {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_spec_factor": 3.0,
               "min_acceptance_rate": 0.0, "draft_token_cost": 0.0, "max_misses": 1000,
               "disable_by_batch_size": 64}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_suffix_decoding_is_lossless_across_requests(model_paths, async_scheduling):
    """The same prompts twice through one engine: the second round also drafts from the
    first round's outputs (the global suffix tree), which the tiny model repeats."""
    def two_rounds(speculative_config):
        core = make_engine(model_paths["llama"], speculative_config=speculative_config,
                           async_scheduling=async_scheduling, kv_cache_memory=KV_MEMORY["llama"], **SETTINGS)
        try:
            first = run_to_completion(core, _prompts(), _params())
            first_stats = core.get_stats().spec_decoding_stats
            second = run_to_completion(core, _prompts(), _params(), first_id=100)
            assert_pool_whole(core)
            return first, second, first_stats, core.get_stats().spec_decoding_stats
        finally:
            core.shutdown()

    expected = two_rounds(None)[:2]
    *got, first_stats, second_stats = two_rounds(SUFFIX_SPEC)
    assert got == list(expected)
    assert first_stats.num_drafts > 10 and 0 < first_stats.num_accepted_tokens < first_stats.num_draft_tokens
    # Greedy outputs repeat the first round's: drafts from them are accepted more often.
    assert (second_stats.num_accepted_tokens / second_stats.num_draft_tokens
            > first_stats.num_accepted_tokens / first_stats.num_draft_tokens)
