"""Tensor parallelism on CPU (2 ranks, gloo): the same outputs as one rank, up to rounding.

Each engine runs with a small KV pool (preemption), shared prompt prefixes
and a hash unit finer than a block (prefix hits, partial-block CoW copies),
and async scheduling; the TP=1 engine with the same settings is the oracle
(itself checked against transformers in tests/model and tests/worker).
"""
from __future__ import annotations

import math

import pytest
import torch
import transformers
from helpers.greedy_check import assert_greedy_continuations, assert_seeded_samples

from tp_helpers import greedy, make_engine, random_prompts, save_tiny_model
from kvserve.engine.core import EngineCoreRequest
from kvserve.sampling_params import SamplingParams
from kvserve.messages import EngineCoreOutput

# Per-rank KV budgets giving both engines the same number of blocks: at TP=2
# each rank holds half of the KV heads, so half the bytes per block.
KV_BYTES_TP1 = 48 * 1024
KV_BYTES_TP2 = KV_BYTES_TP1 // 2
ENGINE_SETTINGS = dict(block_size=4, hash_block_size=2, max_num_seqs=6, max_num_batched_tokens=48)


def _workload() -> list[tuple[list[list[int]], list[SamplingParams]]]:
    shared = list(range(3, 22))
    first = random_prompts(6, 4, 26, seed=1, shared_prefix=shared)
    # The second wave re-sends prefixes of the first: prefix-cache hits inside blocks.
    second = [prompt[:len(prompt) - 3] + [5, 6] for prompt in first[:4]]
    # The third: logprobs and per-request seeded sampling, which only the driver rank does.
    third = random_prompts(3, 5, 12, seed=7)
    third_params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3),
                    SamplingParams(temperature=0.8, seed=11, max_tokens=5, ignore_eos=True),
                    SamplingParams(temperature=1.0, seed=12, top_k=20, max_tokens=5, ignore_eos=True)]
    return [(first, [greedy(14)] * len(first)), (second, [greedy(8)] * len(second)), (third, third_params)]


def _run_workload(core) -> dict[str, list[EngineCoreOutput]]:
    """Every wave's requests (ids continue across waves) run to completion; outputs by request.
    Also counts the CoW block copies the steps carried (in `core.num_block_copies`)."""
    submit = core.executor.execute_model_async
    core.num_block_copies = 0

    def counting_submit(scheduler_output):
        core.num_block_copies += len(scheduler_output.kv_cache_block_copies)
        return submit(scheduler_output)

    core.executor.execute_model_async = counting_submit
    outputs, first_id = {}, 0
    for prompts, params in _workload():
        for i, (prompt, sampling_params) in enumerate(zip(prompts, params)):
            outputs[str(first_id + i)] = []
            core.add_request(EngineCoreRequest(str(first_id + i), prompt, sampling_params))
        first_id += len(prompts)
        while core.has_unfinished_requests():
            for output in core.step():
                outputs[output.request_id].append(output)
    return outputs


def _tokens(outputs: dict[str, list[EngineCoreOutput]]) -> dict[str, list[int]]:
    return {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in outputs.items()}


def _logprobs(outputs: dict[str, list[EngineCoreOutput]]) -> list:
    return [lp for outs in outputs.values() for out in outs for lp in (out.new_logprobs or [])]


@pytest.mark.parametrize("kind", ["llama_gqa", "gemma2"])
def test_tp2_outputs_equal_tp1(kind, tmp_path):
    """Both engines' greedy tokens are greedy under transformers (the all-reduce sums in another
    order, so a near-tie may break either way); logprobs of the same context agree to rounding;
    seeded samples, drawn on the driver from the same logits, agree too."""
    path = save_tiny_model(kind, tmp_path / kind)
    with make_engine(path, 1, kv_cache_memory=KV_BYTES_TP1, **ENGINE_SETTINGS) as core:
        expected = _run_workload(core)
        expected_stats = core.get_stats()
        # Partial-block hits (with their CoW copies) are a full-attention-only feature.
        expects_copies = kind == "llama_gqa"
        assert (core.num_block_copies > 0) == expects_copies
        expected_blocks = core.kv_cache_config.num_blocks
    with make_engine(path, 2, kv_cache_memory=KV_BYTES_TP2, **ENGINE_SETTINGS) as core:
        assert type(core.executor).__name__ == "TPExecutor"
        assert core.kv_cache_config.num_blocks == expected_blocks
        got = _run_workload(core)
        stats = core.get_stats()
        assert (core.num_block_copies > 0) == expects_copies
        pool = core.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == core.kv_cache_config.num_blocks - 1
    _assert_greedy_under_reference(path, _tokens(expected), _tokens(got))
    for run_stats in (expected_stats, stats):
        assert run_stats.num_preemptions > 0, "the small pool should force preemption"
        assert run_stats.prefix_cache_hits > 0
    logprobs, expected_logprobs = _logprobs(got), _logprobs(expected)
    assert len(logprobs) == len(expected_logprobs) == 5
    for lp, expected_lp in zip(logprobs, expected_logprobs):
        if lp.sampled_token_id != expected_lp.sampled_token_id:
            break  # a near-tie broken the other way (checked above): the contexts differ from here
        _assert_top_logprobs_close(lp, expected_lp)


def _assert_greedy_under_reference(path: str, expected: dict[str, list[int]], got: dict[str, list[int]]) -> None:
    """TP=2 sums each rank's half of the o_proj/down_proj columns and then adds the halves, another
    float order than TP=1, so a near-tie may break the other way: both engines' greedy requests
    must be greedy continuations under transformers (float32, `GREEDY_SLACK`), not equal tokens.
    The seeded samples (the last two requests) are checked alike: the draws their seeds give
    from transformers' distribution, teacher forced (`assert_seeded_samples`)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = {str(i): prompt for i, prompt in enumerate(p for wave, _ in _workload() for p in wave)}
    params = {str(i): sp for i, sp in enumerate(sp for _, wave in _workload() for sp in wave)}
    greedy_ids = [rid for rid in prompts if params[rid].temperature == 0.0]
    assert len(greedy_ids) == len(prompts) - 2
    for tokens in (expected, got):
        assert_greedy_continuations(reference, [prompts[rid] for rid in greedy_ids],
                                    [tokens[rid] for rid in greedy_ids])
        for rid in prompts.keys() - set(greedy_ids):
            assert len(tokens[rid]) == params[rid].max_tokens
            assert_seeded_samples(reference, prompts[rid], tokens[rid], params[rid].seed,
                                  params[rid].temperature, params[rid].top_k)


def _assert_top_logprobs_close(lp, expected_lp, tolerance: float = 1e-4) -> None:
    """Top-k logprobs of the same context agree to rounding. 1e-4: a float32 sum of n <= 128
    products is off by at most n * 2**-24 (8e-6) of their magnitudes, the tiny models' logits are
    a few units and their two layers compound that to a few 1e-5 per logit; log-softmax subtracts
    a logsumexp that moves no more than the largest logit, so at most twice that. A token in only
    one top-k list is a near-tie at the k-th place: its logprob is within the bound of the other
    list's k-th."""
    ours = dict(zip(lp.top_token_ids, lp.top_logprobs))
    theirs = dict(zip(expected_lp.top_token_ids, expected_lp.top_logprobs))
    for token_id in ours.keys() | theirs.keys():
        a = ours.get(token_id, min(ours.values()))
        b = theirs.get(token_id, min(theirs.values()))
        assert math.isclose(a, b, abs_tol=tolerance), (token_id, ours, theirs)


def test_tp2_prompt_logprobs_equal_tp1(tmp_path):
    """Prompt logprobs through chunked prefill (a 60-token prompt in 48-token steps, batched with
    a short one): the driver scores the prompt rows every rank computed; values agree to the same
    rounding as the sampled tokens' logprobs above."""
    path = save_tiny_model("llama_gqa", tmp_path / "llama")
    prompts = random_prompts(2, 10, 60, seed=3)
    prompts[0] = (prompts[0] * 6)[:60]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    scored = {}
    for tp_size, kv_bytes in ((1, KV_BYTES_TP1), (2, KV_BYTES_TP2)):
        with make_engine(path, tp_size, kv_cache_memory=kv_bytes, **ENGINE_SETTINGS) as core:
            for i, prompt in enumerate(prompts):
                core.add_request(EngineCoreRequest(str(i), prompt, params))
            outputs = []
            while core.has_unfinished_requests():
                outputs.extend(out for out in core.step() if out.prompt_logprobs is not None)
        scored[tp_size] = {out.request_id: out.prompt_logprobs for out in outputs}
    for req_id, prompt in enumerate(prompts):
        got, expected = scored[2][str(req_id)], scored[1][str(req_id)]
        assert [e.sampled_token_id for e in got] == prompt[1:] == [e.sampled_token_id for e in expected]
        for entry, expected_entry in zip(got, expected):
            assert math.isclose(entry.sampled_logprob, expected_entry.sampled_logprob, abs_tol=1e-4)
            assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(entry.top_logprobs, expected_entry.top_logprobs))
