"""Speculative decoding at TP=2: the driver verifies the drafts and broadcasts a
variable number of tokens per request; greedy tokens equal TP=1 without speculation."""
from __future__ import annotations

from tp_helpers import greedy, make_engine, random_prompts, run_requests, save_tiny_model

SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance_rate": 0.0,
        "draft_token_cost": 0.0, "max_misses": 1000,
        "disable_by_batch_size": 64}


def test_tp2_speculation_matches_tp1_without_it(tmp_path):
    path = save_tiny_model("llama_gqa", tmp_path / "llama")
    prompts = [p + p[:5] + p for p in random_prompts(3, 6, 16, seed=5)]
    reference = make_engine(path, 1)
    try:
        expected = run_requests(reference, prompts, greedy(24))
    finally:
        reference.shutdown()
    core = make_engine(path, 2, speculative_config=SPEC)
    try:
        got = run_requests(core, prompts, greedy(24))
        stats = core.get_stats().spec_decoding_stats
    finally:
        core.shutdown()
    assert got == expected
    assert stats.num_drafts > 0
