"""Mixture-of-experts models at tensor parallelism 2, ranks in their own processes: a tiny
Qwen3-MoE and a tiny gpt-oss (biased experts, sinks, alternating windows) through the engine
(prefix hits, async scheduling) and gpt-oss through `kvserve generate -tp 2`.

Each rank holds half of every expert's rows; the halves' partial sums are all-reduced, another
float order than transformers', so greedy tokens are checked under transformers in float32
(tests/helpers/greedy_check.py), not pinned. A routing decision within rounding of a tie could
flip under that other order and move the logits by a jump no rounding bound covers, so the
prompts are those whose every routing decision, over prompt and transformers' continuation,
clears twice the relative 1.5e-4 bound derived in tests/model/test_moe.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from helpers.greedy_check import assert_greedy_continuations
from helpers.harmony_model import harmony_tokenizer, save_tiny_gpt_oss
from helpers.tiny_models import min_router_margin, random_token_prompts, tiny_moe_config

from tp_helpers import greedy, make_engine, run_requests

MARGIN = 2 * 1.5e-4
MAX_TOKENS = 8
VOCAB = 250  # not a multiple of 4: the vocabulary shards are padded


def _reference(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    model.set_experts_implementation("eager")
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def _clear_of_routing_ties(reference, candidates: list[list[int]]) -> list[list[int]]:
    kept = []
    for prompt in candidates:
        ids = torch.tensor([prompt])
        tokens = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                    min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)[0].tolist()
        if min_router_margin(reference, tokens) > MARGIN:
            kept.append(prompt)
    return kept


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_tp2_moe_greedy_under_transformers(family, tmp_path):
    """Distinct prompts and prompts sharing a 20-token prefix (prefix hits), chunks of 16 tokens."""
    torch.manual_seed(4321)
    path = str(tmp_path / family)
    transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family, VOCAB),
                                                  attn_implementation="eager").eval().save_pretrained(path)
    reference = _reference(path)
    shared = random_token_prompts(VOCAB, 1, 20, 20, seed=11)[0]
    candidates = (random_token_prompts(VOCAB, 6, 3, 24, seed=1)
                  + random_token_prompts(VOCAB, 4, 1, 6, seed=2, shared_prefix=shared))
    prompts = _clear_of_routing_ties(reference, candidates)
    assert len(prompts) >= 4, "too few prompts clear of routing ties"
    with make_engine(path, 2, max_num_batched_tokens=16, kv_cache_memory="4MiB") as core:
        assert type(core.executor).__name__ == "TPExecutor"
        tokens = run_requests(core, prompts, greedy(MAX_TOKENS))
        shared_prompts = sum(prompt[:20] == shared for prompt in prompts)
        assert core.get_stats().prefix_cache_hits > 0 or shared_prompts < 2
    assert_greedy_continuations(reference, prompts, [tokens[str(i)] for i in range(len(prompts))], MAX_TOKENS)


def test_generate_cli_tp2_gpt_oss(tmp_path):
    """`kvserve generate -tp 2 --json` in its own process: its greedy tokens are greedy under
    transformers (prompt text: the first of a few whose routing clears the margin)."""
    path = save_tiny_gpt_oss(str(tmp_path / "gpt_oss"))
    reference = _reference(path)
    tokenizer = harmony_tokenizer()
    texts = [f"Tell me about item {n}." for n in range(8)]
    ids = {text: tokenizer.encode(text, add_special_tokens=False) for text in texts}
    clear = _clear_of_routing_ties(reference, list(ids.values()))
    assert clear, "no prompt clear of routing ties"
    text = next(t for t in texts if ids[t] in clear)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "kvserve", "generate", "--model", path, "-tp", "2", "--json", "--no-chat-template",
         "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--kv-cache-memory", "4MiB", text],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    assert_greedy_continuations(reference, [ids[text]], [answer["token_ids"]])
