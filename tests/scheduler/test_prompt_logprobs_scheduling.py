"""Prompt logprobs through the real scheduler over the fake runner (kvserve.testing): chunked
prefill, preemption and prefix-cache hits, with every prompt position scored exactly once."""
from __future__ import annotations

from helpers.scheduler_engine import make_scheduler_engine_core

from kvserve.engine.core import EngineCoreRequest
from kvserve.sampling_params import SamplingParams


def _run(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request to completion; each one's outputs."""
    outputs = {req_id: [] for req_id in requests}
    for req_id, (prompt, params) in requests.items():
        core.add_request(EngineCoreRequest(req_id, prompt, params))
    while core.has_unfinished_requests():
        for output in core.step():
            outputs[output.request_id].append(output)
    return outputs


def _check_scored_once(outputs: list, prompt: list[int]) -> None:
    carrying = [out for out in outputs if out.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outputs[0]  # with the first sampled token
    entries = carrying[0].prompt_logprobs
    assert [entry.sampled_token_id for entry in entries] == prompt[1:]
    assert all(entry.sampled_logprob == -float(entry.sampled_token_id % 17) / 4.0 for entry in entries)


def test_prompt_logprobs_survive_chunking_and_preemption():
    # 10 blocks of 16 slots for three 40-token prompts growing to 100 tokens each: the three
    # are admitted, then preempted and recomputed (the fake runner scores no prompt twice:
    # a resumed request has sampled already).
    core = make_scheduler_engine_core(num_blocks=11, max_model_len=160)
    prompts = {f"r{i}": [3 + (7 * i + j) % 200 for j in range(40)] for i in range(3)}
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=1)
    outputs = _run(core, {req_id: (prompt, params) for req_id, prompt in prompts.items()})
    assert core.get_stats().num_preemptions > 0
    for req_id, prompt in prompts.items():
        _check_scored_once(outputs[req_id], prompt)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    core.shutdown()


def test_a_request_needing_prompt_logprobs_takes_no_prefix_hit():
    core = make_scheduler_engine_core(num_blocks=64)
    prompt = list(range(3, 83))
    plain = SamplingParams(temperature=0, max_tokens=2)
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    first = _run(core, {"a": (prompt, plain)})
    assert first["a"][0].prompt_logprobs is None
    second = _run(core, {"b": (prompt, scored)})
    assert second["b"][0].num_cached_tokens == 0
    _check_scored_once(second["b"], prompt)
    third = _run(core, {"c": (prompt, plain)})
    assert third["c"][0].num_cached_tokens >= 64  # the cache still serves the others
    core.shutdown()
