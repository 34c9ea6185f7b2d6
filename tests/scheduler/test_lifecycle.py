"""Whole request lifecycles through `FakeModelRunner`, checked against the oracle."""
import pytest

from kvserve.kv_cache.interface import FullAttentionSpec, SlidingWindowSpec
from kvserve.request import RequestStatus
from kvserve.testing import FakeModelRunner, StepDriver, create_requests, create_scheduler

from oracle import assert_pool_whole, assert_results_match, expected_result

EOS = 999
MAX_MODEL_LEN = 160


def _mixed_requests(runner: FakeModelRunner):
    """Four kinds of endings: max_tokens, max_model_len, EOS (with and without
    min_tokens holding it back) and a stop token id."""
    lengths = [1, 7, 16, 17, 33, 64, 90, 140, 150]
    by_length = create_requests(len(lengths), num_tokens=lengths,
                                max_tokens=[3, 40, 1, 25, 60, 9, 80, 30, 50])
    eos = create_requests(6, num_tokens=[5, 20, 31, 48, 3, 70], max_tokens=20, ignore_eos=False,
                          eos_token_id=EOS, id_offset=100)
    held_back = create_requests(3, num_tokens=[12, 40, 9], max_tokens=12, ignore_eos=False,
                                eos_token_id=EOS, min_tokens=10, id_offset=200)
    # A stop token: the token request "300" is known to sample as its 5th output.
    stop_token = runner.token_for("300", 21 + 4, 21)
    stopped = create_requests(2, num_tokens=21, max_tokens=30, stop_token_ids=[stop_token],
                              id_offset=300, prompt_token_ids=list(range(21)))
    return by_length + eos + held_back + stopped


def _run(requests_factory, async_steps: bool, **scheduler_kwargs):
    runner = FakeModelRunner(eos_token_id=EOS, eos_after=6)
    scheduler_kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    scheduler = create_scheduler(async_scheduling=async_steps, **scheduler_kwargs)
    requests = requests_factory(runner)
    driver = StepDriver(scheduler, runner, async_steps=async_steps)
    driver.add_requests(requests)
    results = driver.run()
    return scheduler, runner, requests, results, driver


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("num_blocks", [10_000, 14])
def test_mixed_lengths_finish_with_exact_tokens_and_reasons(async_steps, num_blocks):
    scheduler, runner, requests, results, _ = _run(
        _mixed_requests, async_steps, num_blocks=num_blocks, max_num_batched_tokens=256, max_num_seqs=8)
    assert_results_match(runner, requests, results, MAX_MODEL_LEN)
    reasons = {results[r.request_id].finish_reason for r in requests}
    assert reasons == {"stop", "length"}
    assert any(results[r.request_id].stop_reason is not None for r in requests)
    if num_blocks == 14:
        assert scheduler.num_preemptions > 0
    assert_pool_whole(scheduler)


@pytest.mark.parametrize("num_blocks", [10_000, 12])
def test_async_and_sync_give_identical_outputs(num_blocks):
    kwargs = dict(num_blocks=num_blocks, max_num_batched_tokens=160, max_num_seqs=6)
    *_, sync_results, _ = _run(_mixed_requests, False, **kwargs)
    *_, async_results, driver = _run(_mixed_requests, True, **kwargs)
    assert async_results == sync_results
    # The async run really ran ahead: requests were scheduled before their last token was known.
    assert driver.num_steps_scheduled_ahead > 10


def test_chunked_prefill_never_exceeds_the_budget():
    budget, threshold, max_num_seqs = 64, 24, 5
    scheduler, runner, requests, results, driver = _run(
        lambda _: create_requests(12, num_tokens=[10, 300, 47, 150, 5, 64, 65, 200, 3, 120, 99, 31],
                                  max_tokens=6),
        async_steps=False, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
        max_num_seqs=max_num_seqs, max_model_len=512)
    assert_results_match(runner, requests, results, 512)
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in requests}
    saw_chunking = False
    for out in driver.scheduler_outputs:
        counts = out.num_scheduled_tokens
        assert sum(counts.values()) == out.total_num_scheduled_tokens <= budget
        assert all(n > 0 for n in counts.values())
        assert len(counts) <= max_num_seqs
        for new in out.scheduled_new_reqs:
            saw_chunking |= new.num_computed_tokens + counts[new.req_id] < prompt_len[new.req_id]
        if len(counts) > 1:
            assert max(counts.values()) <= threshold
    assert saw_chunking
    assert_pool_whole(scheduler)


def test_without_chunked_prefill_prompts_run_whole():
    scheduler, runner, requests, results, driver = _run(
        lambda _: create_requests(8, num_tokens=[100, 30, 128, 64, 1, 90, 127, 50], max_tokens=5),
        async_steps=False, max_num_batched_tokens=MAX_MODEL_LEN, enable_chunked_prefill=False)
    assert_results_match(runner, requests, results, MAX_MODEL_LEN)
    prompt_len = {r.request_id: len(r.prompt_token_ids) for r in requests}
    for out in driver.scheduler_outputs:
        for new in out.scheduled_new_reqs:
            assert new.num_computed_tokens + out.num_scheduled_tokens[new.req_id] == prompt_len[new.req_id]
    assert_pool_whole(scheduler)


def test_priorities_decide_admission_order():
    priorities = [5, 1, 3, 0, 4, 1, 2]
    scheduler, runner, requests, results, driver = _run(
        lambda _: create_requests(len(priorities), num_tokens=20, max_tokens=4, priorities=priorities),
        async_steps=False, policy="priority", max_num_seqs=1)
    admitted = [new.req_id for out in driver.scheduler_outputs for new in out.scheduled_new_reqs]
    by_rank = sorted(requests, key=lambda r: (r.priority, r.arrival_time))
    assert admitted == [r.request_id for r in by_rank]
    assert_results_match(runner, requests, results, MAX_MODEL_LEN)


def test_priority_victim_is_the_lowest_priority_not_the_latest():
    # Two short prompts share the pool's two blocks; the high-priority request,
    # admitted last, reaches a block boundary first.
    scheduler = create_scheduler(num_blocks=3, policy="priority", max_model_len=64)
    runner = FakeModelRunner()
    low, high = create_requests(2, num_tokens=[8, 15], max_tokens=6, priorities=[9, 0])
    driver = StepDriver(scheduler, runner)
    driver.add_requests([low])
    driver.step()
    driver.add_requests([high])
    driver.step()
    driver.step()
    assert scheduler.running == [low, high]
    out = driver.schedule_step()
    # FCFS would preempt `high` (the latest, i.e. itself); priority picks `low`,
    # already scheduled earlier in this step, and refunds its token.
    assert out.preempted_req_ids == {low.request_id}
    assert low.status == RequestStatus.PREEMPTED
    assert out.num_scheduled_tokens == {high.request_id: 1}
    assert out.scheduled_cached_reqs.req_ids == [high.request_id]
    driver.process_step()
    results = driver.run()
    assert_results_match(runner, [low, high], results, 64)
    assert_pool_whole(scheduler)


@pytest.mark.parametrize("async_steps", [False, True])
def test_aborts_in_every_state_free_everything(async_steps):
    scheduler = create_scheduler(num_blocks=10, max_num_batched_tokens=32, max_num_seqs=3,
                                 max_model_len=128, async_scheduling=async_steps)
    runner = FakeModelRunner()
    driver = StepDriver(scheduler, runner, async_steps=async_steps)
    requests = create_requests(7, num_tokens=[40, 8, 8, 20, 16, 5, 9], max_tokens=[50, 60, 60, 50, 50, 50, 5])
    driver.add_requests(requests)
    never_scheduled = requests[-1]
    assert scheduler.finish_requests([never_scheduled.request_id, "no-such-id"],
                                     RequestStatus.FINISHED_ABORTED) == [never_scheduled]
    assert scheduler.finish_requests(never_scheduled.request_id, RequestStatus.FINISHED_ABORTED) == []
    aborted_by_state = {}
    for _ in range(300):
        driver.step()
        candidates_by_state = {
            "mid-prefill": [r for r in scheduler.running if 0 < r.num_computed_tokens < r.num_prompt_tokens],
            "decoding": [r for r in scheduler.running if r.num_output_tokens > 0],
            "preempted": [r for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED],
        }
        for state, candidates in candidates_by_state.items():
            if state not in aborted_by_state and candidates:
                request = candidates[0]
                assert scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED) == [request]
                assert request.status == RequestStatus.FINISHED_ABORTED
                aborted_by_state[state] = request
        if len(aborted_by_state) == 3:
            break
    assert set(aborted_by_state) == {"mid-prefill", "decoding", "preempted"}
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    while driver.in_flight:  # the outputs of aborted requests are dropped
        assert all(not out.new_token_ids for out in driver.process_step())
    scheduler.schedule()  # deferred frees drain at the start of a step
    assert_pool_whole(scheduler)


def test_pause_modes():
    def start(num_requests=4):
        scheduler = create_scheduler(max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
        driver = StepDriver(scheduler, FakeModelRunner())
        requests = create_requests(num_requests, num_tokens=12, max_tokens=8)
        driver.add_requests(requests)
        for _ in range(3):
            driver.step()
        return scheduler, driver, requests

    # abort: everything finishes as aborted, and nothing new is admitted until resume.
    scheduler, driver, requests = start()
    aborted = scheduler.pause("abort")
    assert sorted(r.request_id for r in aborted) == sorted(r.request_id for r in requests)
    late = create_requests(1, id_offset=10)
    driver.add_requests(late)
    assert scheduler.schedule().is_empty
    assert scheduler.get_num_unfinished_requests() == 0
    scheduler.resume()
    assert driver.run()[late[0].request_id].finish_reason == "length"
    assert_pool_whole(scheduler)

    # wait: running requests finish, waiting ones stay until resume.
    scheduler, driver, requests = start()
    scheduler.pause("wait")
    running_ids = {r.request_id for r in scheduler.running}
    assert scheduler.get_num_unfinished_requests() == len(running_ids) == 2
    driver.run()
    assert {rid for rid, res in driver.results.items() if res.finish_reason} == running_ids
    assert len(scheduler.waiting) == 2
    scheduler.resume()
    results = driver.run()
    assert_results_match(driver.runner, requests, results, MAX_MODEL_LEN)

    # keep: nothing is scheduled and the engine sees no work; resume goes on as if never paused.
    scheduler, driver, requests = start()
    scheduler.pause("keep")
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.schedule().is_empty
    assert len(scheduler.requests) == 4
    scheduler.resume()
    results = driver.run()
    assert_results_match(driver.runner, requests, results, MAX_MODEL_LEN)
    assert_pool_whole(scheduler)
    with pytest.raises(ValueError):
        scheduler.pause("nap")


def test_prompts_that_can_never_run_are_ignored_with_a_reason():
    scheduler = create_scheduler(num_blocks=5, block_size=16, max_model_len=100)
    too_long, too_big, fits = create_requests(3, num_tokens=[101, 70, 64], max_tokens=100)
    driver = StepDriver(scheduler, FakeModelRunner())
    driver.add_requests([too_long, too_big, fits])
    assert too_long.status == too_big.status == RequestStatus.FINISHED_IGNORED
    results = driver.run()
    # Longer than max_model_len is longer than the pool allows too (the engine's
    # RequestValidator rejects it before it gets here).
    assert results["0"].finish_reason == "length" and "KV cache" in results["0"].stop_reason
    assert results["1"].finish_reason == "length" and "KV cache" in results["1"].stop_reason
    assert results["0"].token_ids == results["1"].token_ids == []
    # 4 usable blocks hold 64 tokens: generation stops when the pool is full.
    assert results["2"].finish_reason == "length"
    assert len(results["2"].token_ids) == 1
    assert_pool_whole(scheduler)


def test_logprobs_pass_through():
    scheduler = create_scheduler()
    runner = FakeModelRunner()
    with_lp = create_requests(2, num_tokens=9, max_tokens=5, logprobs=2)
    without = create_requests(1, num_tokens=9, max_tokens=5, id_offset=2)
    driver = StepDriver(scheduler, runner)
    driver.add_requests(with_lp + without)
    results = driver.run()
    for request in with_lp:
        result = results[request.request_id]
        assert [lp.sampled_token_id for lp in result.logprobs] == result.token_ids
    assert results["2"].logprobs == []


@pytest.mark.parametrize("async_steps", [False, True])
def test_hybrid_full_and_sliding_window_groups(async_steps):
    specs = [FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32"),
             SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32",
                               sliding_window=32)]
    scheduler, runner, requests, results, _ = _run(
        _mixed_requests, async_steps, num_blocks=40, kv_cache_specs=specs,
        max_num_batched_tokens=64, max_num_seqs=6)
    assert_results_match(runner, requests, results, MAX_MODEL_LEN)
    assert_pool_whole(scheduler)


def test_prefix_cache_hits_and_stats():
    scheduler = create_scheduler()
    driver = StepDriver(scheduler, FakeModelRunner())
    first = create_requests(1, num_tokens=64, max_tokens=2, same_prompt=True)
    driver.add_requests(first)
    driver.run()
    scheduler.make_stats()
    second = create_requests(1, num_tokens=64, max_tokens=2, same_prompt=True, id_offset=1)
    driver.add_requests(second)
    driver.step()
    assert second[0].num_cached_tokens == 48  # whole blocks, never the last prompt token
    stats = scheduler.make_stats()
    assert stats.num_running_reqs == 1 and stats.num_waiting_reqs == 0
    assert stats.prefix_cache_hits == 48 and stats.prefix_cache_queries == 64
    assert stats.prefix_cache_hit_rate == 0.75
    assert 0 < stats.kv_cache_usage < 1
    assert stats.sched_step_seq == stats.processed_step_seq
    driver.run()
    assert_pool_whole(scheduler)


def test_expected_result_oracle_sanity():
    runner = FakeModelRunner(eos_token_id=EOS, eos_after=2)
    request = create_requests(1, num_tokens=4, max_tokens=10, ignore_eos=False, eos_token_id=EOS)[0]
    result = expected_result(runner, request, MAX_MODEL_LEN)
    assert result.token_ids[-1] == EOS and len(result.token_ids) == 3 and result.finish_reason == "stop"
