"""The scheduler's side of speculative decoding, against FakeModelRunner."""
from __future__ import annotations

import pytest

from kvserve.config import ConfigError
from kvserve.scheduler.speculation import Speculator
from kvserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from kvserve.spec_decode.ngram import propose_ngram
from kvserve.testing import FakeModelRunner, StepDriver, create_requests, create_scheduler
from kvserve.engine.create_config import create_engine_config

from oracle import assert_pool_whole, assert_results_match


def test_ngram_takes_the_longest_suffix_and_its_latest_occurrence():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 2, 4, 3) == [4, 5, 9]
    # [9, 1, 2] recurs at two places; the 4-gram [5, 9, 1, 2] only once.
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2], 2, 4, 3) == [3, 4, 5]
    assert propose_ngram([7, 8, 1, 2, 6, 1, 2], 2, 2, 5) == [6, 1, 2]  # stops at the end of the sequence
    assert propose_ngram([1, 2, 3, 4], 2, 3, 3) == []
    assert propose_ngram([5, 5, 5], 1, 1, 0) == []


@pytest.mark.parametrize("value,message", [
    ({"method": "eagle"}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
    ({"num_speculative_tokens": "3"}, "must be an integer"),
    ({"bogus": 1}, "unknown key"),
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
])
def test_bad_speculative_configs_are_one_line_errors(value, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.from_value(value)


def test_engine_config_takes_vllm_dicts_and_json():
    config = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 2, 4)
    with pytest.raises(ConfigError, match="speculative_config"):
        create_engine_config(model="/nonexistent", speculative_config={"method": "x"})


def _spec_scheduler(**kwargs):
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             **kwargs.pop("spec", {}))
    return create_scheduler(block_size=4, max_num_batched_tokens=64, max_model_len=200,
                            speculative_config=spec, **kwargs)


def test_drafts_get_lookahead_slots_are_never_hashed_and_roll_back():
    scheduler = _spec_scheduler(hash_block_size=2)
    runner = FakeModelRunner(period=2, block_size=4)
    request = create_requests(1, prompt_token_ids=[[5, 6, 7, 8, 5, 6, 7]], max_tokens=30)[0]
    scheduler.add_request(request)
    driver = StepDriver(scheduler, runner)
    num_rolled_back = 0
    for _ in range(40):
        if driver.is_done():
            break
        out = scheduler.schedule()
        drafts = out.scheduled_spec_decode_tokens.get(request.request_id, [])
        if drafts:
            assert out.num_scheduled_tokens[request.request_id] == 1 + len(drafts)
            # Hashes cover known tokens only: the drafts are not part of them.
            assert len(request.block_hashes) == request.num_tokens // 2
            blocks = scheduler.kv_cache_manager.get_blocks(request.request_id).blocks[0]
            assert len(blocks) * 4 >= request.num_computed_tokens
            hashed = [b.block_hash_num_tokens for b in blocks if b.block_hash is not None]
            assert max(hashed, default=0) <= request.num_tokens
        runner_output = runner.execute(out)
        known_before = request.num_tokens
        scheduler.update_from_output(out, runner_output)
        if drafts and not request.is_finished():
            emitted = request.num_tokens - known_before
            assert request.num_computed_tokens == request.num_tokens - 1
            num_rolled_back += len(drafts) + 1 - emitted
    assert driver.is_done() or request.is_finished()
    assert num_rolled_back > 0
    assert_results_match(runner, [request], {request.request_id: _result(request)}, scheduler.max_model_len)
    assert_pool_whole(scheduler)


def _result(request):
    from kvserve.testing import RequestResult
    return RequestResult(list(request.output_token_ids), request.get_finished_reason(), request.stop_reason)


def test_async_steps_wait_for_a_speculating_request_and_pipeline_otherwise():
    scheduler = _spec_scheduler(async_scheduling=True)
    runner = FakeModelRunner(period=2, block_size=4)
    requests = create_requests(1, prompt_token_ids=[[5, 6, 7, 8, 5, 6, 7]], max_tokens=20)
    driver = StepDriver(scheduler, runner, async_steps=True)
    driver.add_requests(requests)
    results = driver.run()
    assert_results_match(runner, requests, results, scheduler.max_model_len)
    assert_pool_whole(scheduler)
    assert any(out.scheduled_spec_decode_tokens for out in driver.scheduler_outputs)
    # A request is never scheduled while its step with drafts is in flight.
    for previous, current in zip(driver.scheduler_outputs, driver.scheduler_outputs[1:]):
        if previous.scheduled_spec_decode_tokens and current.num_scheduled_tokens:
            assert not previous.scheduled_spec_decode_tokens.keys() & current.num_scheduled_tokens.keys()


def test_large_batches_and_failing_drafts_turn_speculation_off():
    # Four requests with disable_by_batch_size 4: no drafts at all, every decode pipelined.
    scheduler = _spec_scheduler(async_scheduling=True, spec={"disable_by_batch_size": 4})
    runner = FakeModelRunner(period=2, block_size=4)
    driver = StepDriver(scheduler, runner, async_steps=True)
    driver.add_requests(create_requests(4, prompt_token_ids=[[5, 6, 7, 8, 5, 6, 7]] * 4, max_tokens=12))
    driver.run()
    assert not any(out.scheduled_spec_decode_tokens for out in driver.scheduler_outputs)
    assert driver.num_steps_scheduled_ahead > 0
    # Outputs that never repeat: no draft is found, the request backs off and pipelines.
    scheduler = _spec_scheduler(async_scheduling=True, spec={"backoff_steps": 1000})
    runner = FakeModelRunner(block_size=4)
    driver = StepDriver(scheduler, runner, async_steps=True)
    driver.add_requests(create_requests(1, prompt_token_ids=[[5, 6, 5, 6, 5, 6]], max_tokens=40))
    driver.run()
    assert driver.num_steps_scheduled_ahead > 25


def test_low_acceptance_backs_off_for_a_while():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, min_acceptance_rate=0.3,
                                              backoff_steps=5))
    request = create_requests(1)[0]
    speculator.begin_step()
    speculator.record(request.request_id, 3, 1)
    assert speculator.wants_drafts(request, num_running=1)
    speculator.record(request.request_id, 3, 0)  # 1 of 4.5 weighted drafts accepted
    assert not speculator.wants_drafts(request, num_running=1)
    for _ in range(5):
        speculator.begin_step()
    assert speculator.wants_drafts(request, num_running=1)
    stats = speculator.take_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]
    assert speculator.take_stats().num_drafts == 0
