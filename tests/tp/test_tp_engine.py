"""Tensor parallelism on CPU (2 ranks, gloo): the same greedy tokens as one rank.

Each engine runs with a small KV pool (preemption), shared prompt prefixes
and a hash unit finer than a block (prefix hits, partial-block CoW copies),
and async scheduling; the TP=1 engine with the same settings is the oracle.
"""
from __future__ import annotations

import math

import pytest

from tp_helpers import greedy, make_engine, random_prompts, run_requests, save_tiny_model
from kvserve.sampling_params import SamplingParams

# Per-rank KV budgets giving both engines the same number of blocks: at TP=2
# each rank holds half of the KV heads, so half the bytes per block.
KV_BYTES_TP1 = 48 * 1024
KV_BYTES_TP2 = KV_BYTES_TP1 // 2
ENGINE_SETTINGS = dict(block_size=4, hash_block_size=2, max_num_seqs=6, max_num_batched_tokens=48)


def _workload() -> list[tuple[list[list[int]], SamplingParams]]:
    shared = list(range(3, 22))
    first = random_prompts(6, 4, 26, seed=1, shared_prefix=shared)
    # The second wave re-sends prefixes of the first: prefix-cache hits inside blocks.
    second = [prompt[:len(prompt) - 3] + [5, 6] for prompt in first[:4]]
    return [(first, greedy(14)), (second, greedy(8))]


def _run_workload(core) -> list[dict[str, list[int]]]:
    results, first_id = [], 0
    for prompts, params in _workload():
        results.append(run_requests(core, prompts, params, first_id=first_id))
        first_id += len(prompts)
    return results


@pytest.mark.parametrize("kind", ["llama_gqa", "gemma2"])
def test_tp2_greedy_equals_tp1(kind, tmp_path):
    path = save_tiny_model(kind, tmp_path / kind)
    with make_engine(path, 1, kv_cache_memory=KV_BYTES_TP1, **ENGINE_SETTINGS) as core:
        expected = _run_workload(core)
        expected_stats = core.get_stats()
        expected_blocks = core.kv_cache_config.num_blocks
    with make_engine(path, 2, kv_cache_memory=KV_BYTES_TP2, **ENGINE_SETTINGS) as core:
        assert type(core.executor).__name__ == "TPExecutor"
        assert core.kv_cache_config.num_blocks == expected_blocks
        got = _run_workload(core)
        stats = core.get_stats()
        pool = core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == core.kv_cache_config.num_blocks - 1
    assert got == expected
    for run_stats in (expected_stats, stats):
        assert run_stats.num_preemptions > 0, "the small pool should force preemption"
        assert run_stats.prefix_cache_hits > 0


def test_tp2_logprobs_and_seeded_sampling_come_from_the_driver(tmp_path):
    """Logprobs and per-request seeded samples at TP=2 agree with TP=1 (the logits
    differ only by all-reduce rounding)."""
    path = save_tiny_model("llama_gqa", tmp_path / "llama")
    prompts = random_prompts(3, 5, 12, seed=7)
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, seed=11, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=12, top_k=20, max_tokens=5, ignore_eos=True)]
    outputs = {}
    for tp, kv_bytes in ((1, 1 << 20), (2, 1 << 19)):
        with make_engine(path, tp, kv_cache_memory=kv_bytes) as core:
            outputs[tp] = _collect_outputs(core, prompts, params)
    tokens = {tp: {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in by_req.items()}
              for tp, by_req in outputs.items()}
    assert tokens[2] == tokens[1]
    logprobs = {tp: [lp for out in outputs[tp]["0"] for lp in (out.new_logprobs or [])] for tp in outputs}
    assert len(logprobs[2]) == len(logprobs[1]) == 5
    for lp2, lp1 in zip(logprobs[2], logprobs[1]):
        assert lp2.top_token_ids == lp1.top_token_ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp2.top_logprobs, lp1.top_logprobs))


def _collect_outputs(core, prompts, params):
    from kvserve.engine.core import EngineCoreRequest
    by_req = {}
    for i, (prompt, sampling_params) in enumerate(zip(prompts, params)):
        by_req[str(i)] = []
        core.add_request(EngineCoreRequest(str(i), prompt, sampling_params))
    while core.has_unfinished_requests():
        for output in core.step():
            by_req[output.request_id].append(output)
    return by_req
