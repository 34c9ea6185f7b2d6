"""EngineCore at one step at a time: steps run inline on the engine's thread, a single stream
goes one step at a time where the model step keeps every core busy, and the tokens are those
of a step ahead (async) and of a plain synchronous engine."""
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
from engine_helpers import assert_pool_whole, greedy_params, make_engine, run_to_completion  # noqa: E402
from tiny_models import VOCAB_SIZE, save_tiny_model  # noqa: E402

from kvserve.engine.core import EngineCoreRequest  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402
from kvserve.worker.executor import UniProcExecutor  # noqa: E402


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama_inline"))


def _record_steps(core):
    """Per submitted step: (steps ahead of the last processed one, thread the runner ran it on)."""
    submitted, ran_on = [], []
    submit, execute = core.executor.execute_model_async, core.executor.model_runner.execute_model

    def recording_submit(scheduler_output):
        if not scheduler_output.is_empty:
            submitted.append(scheduler_output.step_seq - core.scheduler.processed_step_seq)
        return submit(scheduler_output)

    def recording_execute(scheduler_output):
        if not scheduler_output.is_empty:
            ran_on.append(threading.get_ident())
        return execute(scheduler_output)

    core.executor.execute_model_async = recording_submit
    core.executor.model_runner.execute_model = recording_execute
    return submitted, ran_on


def _prompts(num: int, length: int = 9):
    return [[(7 * i + 3 * j) % (VOCAB_SIZE - 3) + 3 for j in range(length + i)] for i in range(num)]


@pytest.fixture
def no_spare_cpu(monkeypatch):
    """Every core busy with the model step, whatever this machine has."""
    monkeypatch.setattr(UniProcExecutor, "spare_cpu_for_host_work", property(lambda self: False))


def test_single_stream_runs_inline_one_step_at_a_time_without_a_spare_core(llama_path, no_spare_cpu):
    core = make_engine(llama_path, async_scheduling=True)
    reference = make_engine(llama_path, async_scheduling=True)
    reference.schedule_ahead = True  # the step ahead, on the step thread, as before
    try:
        submitted, ran_on = _record_steps(core)
        ref_submitted, ref_ran_on = _record_steps(reference)
        params = [greedy_params(20), SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=20,
                                                    ignore_eos=True)]
        for i, sp in enumerate(params):
            prompt = _prompts(1, 11 + i)
            tokens = run_to_completion(core, prompt, sp, first_id=10 * i)
            assert tokens == run_to_completion(reference, prompt, sp, first_id=10 * i)
        assert set(submitted) == {1} and set(ran_on) == {threading.get_ident()}
        assert max(ref_submitted) == 2 and threading.get_ident() not in ref_ran_on
        assert_pool_whole(core)
    finally:
        core.shutdown()
        reference.shutdown()


def test_batches_still_schedule_ahead_without_a_spare_core(llama_path, no_spare_cpu):
    """Two requests or more: a step ahead, on the step thread; the last one alone goes inline."""
    core = make_engine(llama_path, async_scheduling=True)
    try:
        submitted, ran_on = _record_steps(core)
        prompts = _prompts(4)
        tokens = run_to_completion(core, prompts, [greedy_params(6 + 6 * i) for i in range(4)])
        assert max(submitted) == 2 and submitted[-1] == 1
        assert threading.get_ident() in ran_on and len(set(ran_on)) == 2
        assert all(len(tokens[str(i)]) == 6 + 6 * i for i in range(4))
        assert_pool_whole(core)
    finally:
        core.shutdown()


def test_a_spare_core_keeps_the_single_stream_a_step_ahead(llama_path, monkeypatch):
    monkeypatch.setattr(UniProcExecutor, "spare_cpu_for_host_work", property(lambda self: True))
    core = make_engine(llama_path, async_scheduling=True)
    try:
        submitted, ran_on = _record_steps(core)
        run_to_completion(core, _prompts(1), greedy_params(12))
        assert max(submitted) == 2 and threading.get_ident() not in ran_on
    finally:
        core.shutdown()


def test_sync_engine_runs_steps_inline_and_equals_the_step_thread(llama_path):
    inline = make_engine(llama_path, async_scheduling=False)
    threaded = make_engine(llama_path, async_scheduling=False)
    try:
        _, ran_on = _record_steps(inline)
        threaded_submit = threaded.executor.execute_model_async

        def on_step_thread(scheduler_output):
            threaded.executor.inline_steps = False
            return threaded_submit(scheduler_output)

        threaded.executor.execute_model_async = on_step_thread
        prompts = _prompts(3)
        params = [greedy_params(9), SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),
                  greedy_params(4, logprobs=2)]
        assert run_to_completion(inline, prompts, params) == run_to_completion(threaded, prompts, params)
        assert set(ran_on) == {threading.get_ident()}
        assert_pool_whole(inline)
    finally:
        inline.shutdown()
        threaded.shutdown()


def test_an_inline_step_that_fails_fails_its_requests_not_the_engine(llama_path):
    core = make_engine(llama_path, async_scheduling=False)
    runner = core.executor.model_runner
    execute = runner.execute_model
    calls = []

    def failing_once(scheduler_output):
        calls.append(scheduler_output.step_seq)
        if len(calls) == 3:
            raise RuntimeError("kernel failed")
        return execute(scheduler_output)

    runner.execute_model = failing_once
    try:
        core.add_request(EngineCoreRequest("a", _prompts(1)[0], greedy_params(8)))
        outputs = []
        while core.has_unfinished_requests():
            outputs.extend(core.step())
        assert outputs[-1].finish_reason == "error" and "kernel failed" in outputs[-1].stop_reason
        assert len(run_to_completion(core, _prompts(1), greedy_params(5), first_id=1)["1"]) == 5
        assert_pool_whole(core)
    finally:
        core.shutdown()
