"""EngineCore on a tiny random Llama: many random requests without leaks, async = sync,
aborts, request validation, and failed model steps that fail their requests, not the engine."""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
from engine_helpers import assert_pool_whole, greedy_params, make_engine, run_to_completion  # noqa: E402
from helpers.greedy_check import assert_greedy_continuations  # noqa: E402
from tiny_models import VOCAB_SIZE, load_reference, save_tiny_model  # noqa: E402

from kvserve.engine.core import EngineCoreRequest  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def random_workload(num_requests: int, seed: int = 0):
    """Random prompt lengths and output lengths; greedy, seeded-random and EOS-honouring requests."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(num_requests):
        prompts.append([rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 60))])
        max_tokens = rng.randint(1, 24)
        kind = i % 3
        if kind == 0:
            params.append(greedy_params(max_tokens))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1000 + i,
                                         max_tokens=max_tokens, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens))  # may stop at EOS
    return prompts, params


def test_hundred_random_requests_no_leaks_and_async_equals_sync(llama_path):
    prompts, params = random_workload(100)
    # A small pool (preemptions) and budget (chunked prefills) against a roomy sync run.
    small = make_engine(llama_path, kv_cache_memory=90 * 1024, max_num_seqs=32,
                        max_num_batched_tokens=64, async_scheduling=True)
    roomy = make_engine(llama_path, max_num_seqs=32, async_scheduling=False)
    try:
        small_outputs = run_to_completion(small, prompts, params)
        roomy_outputs = run_to_completion(roomy, prompts, params)
        assert small.get_stats().num_preemptions > 0
        for i, sp in enumerate(params):
            tokens = small_outputs[str(i)]
            assert 1 <= len(tokens) <= sp.max_tokens
            if sp.ignore_eos:
                assert len(tokens) == sp.max_tokens
            else:
                assert len(tokens) == sp.max_tokens or tokens[-1] == 2
        # Greedy and seeded sampling do not depend on batch composition or preemption.
        assert small_outputs == roomy_outputs
        assert_pool_whole(small)
        assert_pool_whole(roomy)
        assert small.reset_prefix_cache()
    finally:
        small.shutdown()
        roomy.shutdown()


def test_greedy_matches_transformers_through_engine_core(llama_path):
    prompts, _ = random_workload(6, seed=3)
    core = make_engine(llama_path)
    try:
        outputs = run_to_completion(core, prompts, greedy_params(10))
        assert_greedy_continuations(load_reference(llama_path), prompts, [outputs[str(i)] for i in range(len(prompts))],
                                    10)
    finally:
        core.shutdown()


def test_abort_running_and_waiting_requests_frees_everything(llama_path):
    core = make_engine(llama_path, max_num_seqs=2)
    try:
        for i in range(4):
            core.add_request(EngineCoreRequest(str(i), [5 + i] * 10, greedy_params(50)))
        seen: dict[str, int] = {}
        for _ in range(4):
            for output in core.step():
                seen[output.request_id] = seen.get(output.request_id, 0) + len(output.new_token_ids)
        assert seen, "running requests produced tokens"
        core.abort_requests(["0", "3"])  # one running, one still waiting
        outputs = {}
        while core.has_unfinished_requests():
            for output in core.step():
                assert output.request_id not in ("0", "3")
                outputs.setdefault(output.request_id, []).append(output)
        assert {rid for rid, outs in outputs.items() if outs[-1].finished} == {"1", "2"}
        assert_pool_whole(core)
    finally:
        core.shutdown()


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    ([7] * 512, "maximum context length"),
    ([VOCAB_SIZE + 5], "out of range"),
])
def test_add_request_rejects_unservable_prompts(llama_path, prompt, message):
    core = make_engine(llama_path)
    try:
        with pytest.raises(ValueError, match=message):
            core.add_request(EngineCoreRequest("x", prompt, greedy_params(4)))
        core.add_request(EngineCoreRequest("dup", [3, 4], greedy_params(4)))
        with pytest.raises(ValueError, match="already"):
            core.add_request(EngineCoreRequest("dup", [3, 4], greedy_params(4)))
    finally:
        core.shutdown()


POISON_TOKEN = 250


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_model_step_fails_its_requests_and_engine_goes_on(llama_path, async_scheduling):
    core = make_engine(llama_path, async_scheduling=async_scheduling)
    model = core.executor.model_runner.model
    real_forward = model._forward  # under both forward and forward_logits

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == POISON_TOKEN).any()):
            raise RuntimeError("injected model failure")
        return real_forward(input_ids, *args, **kwargs)

    model._forward = forward
    try:
        before = run_to_completion(core, [[10, 11, 12]], greedy_params(6))
        core.add_request(EngineCoreRequest("poison", [9, POISON_TOKEN, 9], greedy_params(6)))
        core.add_request(EngineCoreRequest("bystander", [10, 11, 12], greedy_params(6)))
        finished = {}
        for _ in range(100):
            if not core.has_unfinished_requests():
                break
            for output in core.step():
                if output.finished:
                    finished[output.request_id] = output
        assert finished["poison"].finish_reason == "error"
        assert "injected model failure" in finished["poison"].stop_reason
        assert finished["bystander"].finish_reason == "error"  # it shared the failed step
        after = run_to_completion(core, [[10, 11, 12]], greedy_params(6), first_id=50)
        assert after["50"] == before["0"]
        assert_pool_whole(core)
    finally:
        core.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_keeps_one_step_in_flight(llama_path, async_scheduling):
    """Async: step N+1 is submitted before step N's output is applied (never further
    ahead). Sync: every step is submitted after the previous one was applied."""
    core = make_engine(llama_path, async_scheduling=async_scheduling)
    submit = core.executor.execute_model_async
    steps_ahead = []

    def recording_submit(scheduler_output):
        if not scheduler_output.is_empty:
            steps_ahead.append(scheduler_output.step_seq - core.scheduler.processed_step_seq)
        return submit(scheduler_output)

    core.executor.execute_model_async = recording_submit
    try:
        prompts, _ = random_workload(8, seed=5)
        run_to_completion(core, prompts, greedy_params(8))
        if async_scheduling:
            assert max(steps_ahead) == 2 and steps_ahead.count(2) > len(steps_ahead) // 2
        else:
            assert set(steps_ahead) == {1}
        assert_pool_whole(core)
    finally:
        core.shutdown()


def test_a_stuck_scheduler_raises_instead_of_hanging(llama_path):
    from kvserve.errors import EngineDeadError
    from kvserve.messages import SchedulerOutput

    core = make_engine(llama_path)
    try:
        core.add_request(EngineCoreRequest("0", [5, 6, 7], greedy_params(4)))
        core.scheduler.schedule = lambda: SchedulerOutput.make_empty(core.scheduler.sched_step_seq)
        with pytest.raises(EngineDeadError, match="scheduled nothing"):
            for _ in range(10_000):
                core.step()
        with pytest.raises(EngineDeadError):
            core.add_request(EngineCoreRequest("1", [5], greedy_params(4)))
    finally:
        core.shutdown()
