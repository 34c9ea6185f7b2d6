"""Speculative decoding at TP=2: the driver verifies the drafts and broadcasts a
variable number of tokens per request; the tokens are greedy under transformers."""
from __future__ import annotations

import torch
import transformers
from helpers.greedy_check import assert_greedy_continuations

from tp_helpers import greedy, make_engine, random_prompts, run_requests, save_tiny_model

SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance_rate": 0.0,
        "draft_token_cost": 0.0, "max_misses": 1000,
        "disable_by_batch_size": 64}


def test_tp2_speculation_is_greedy(tmp_path):
    """Checked teacher forced under transformers (float32), not against TP=1's tokens: TP=2 adds
    the ranks' partial o_proj/down_proj sums in another float order, so a near-tie may break the
    other way (`assert_greedy_continuations` allows exactly that)."""
    path = save_tiny_model("llama_gqa", tmp_path / "llama")
    prompts = [p + p[:5] + p for p in random_prompts(3, 6, 16, seed=5)]
    core = make_engine(path, 2, speculative_config=SPEC)
    try:
        got = run_requests(core, prompts, greedy(24))
        stats = core.get_stats().spec_decoding_stats
    finally:
        core.shutdown()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    assert_greedy_continuations(reference, prompts, [got[str(i)] for i in range(len(prompts))], 24)
    assert stats.num_drafts > 0
