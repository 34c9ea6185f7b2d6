"""A dead executor is an EngineDeadError from EngineCore, wherever it is found: when a step is
submitted, when its result is collected, or in a health check while idle. The fake executor
dies at the chosen point (no timing), with a reason naming a node and a rank as the
tensor-parallel executor's do."""
import pytest

from kvserve.engine.core import EngineCore, EngineCoreRequest
from kvserve.errors import EngineDeadError
from kvserve.sampling_params import SamplingParams
from kvserve.testing import FakeExecutor, fake_engine_config
from kvserve.worker.executor import ExecutorDeadError

REASON = "lost tensor-parallel rank 1 on node 1: no answer to a heartbeat within 5 s"


def _core() -> tuple[EngineCore, list[int]]:
    """An EngineCore over a FakeExecutor, and the step numbers the executor accepted."""
    core = EngineCore(fake_engine_config(), executor_class=FakeExecutor)
    accepted: list[int] = []
    core.executor.on_submit = lambda scheduler_output: accepted.append(scheduler_output.step_seq)
    return core, accepted


def _add(core: EngineCore, request_id: str = "r") -> None:
    core.add_request(EngineCoreRequest(request_id, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=20)))


def _assert_dead_for_good(core: EngineCore) -> None:
    for call in (core.step, core.check_health):
        with pytest.raises(EngineDeadError, match="rank 1 on node 1"):
            call()


def test_death_found_when_a_step_is_submitted():
    core, accepted = _core()
    _add(core)
    core.executor.kill(REASON, when="submit")
    with pytest.raises(EngineDeadError, match="the executor died: lost tensor-parallel rank 1 on node 1") as info:
        core.step()
    assert isinstance(info.value.__cause__, ExecutorDeadError)
    assert accepted == []  # refused at submission
    _assert_dead_for_good(core)
    core.shutdown()


def test_death_found_when_a_step_is_collected():
    core, accepted = _core()
    core.schedule_ahead = False  # collect each step before the next is submitted
    _add(core)
    core.step()
    core.executor.kill(REASON, when="collect")
    with pytest.raises(EngineDeadError, match="the executor died: lost tensor-parallel rank 1 on node 1") as info:
        core.step()
    assert isinstance(info.value.__cause__, ExecutorDeadError)
    assert len(accepted) == 2  # the second step was accepted, then failed
    _assert_dead_for_good(core)
    core.shutdown()


def test_death_found_by_a_health_check_while_idle():
    core, accepted = _core()
    core.check_health()
    core.executor.kill(REASON, when="now")
    with pytest.raises(EngineDeadError, match="the executor died: lost tensor-parallel rank 1 on node 1"):
        core.check_health()
    with pytest.raises(EngineDeadError, match="rank 1 on node 1"):
        _add(core)
    _assert_dead_for_good(core)
    assert accepted == []
    core.shutdown()


def test_a_step_error_on_a_healthy_executor_fails_only_its_requests():
    core, _ = _core()
    core.schedule_ahead = False
    _add(core)
    core.executor.error_next_step = RuntimeError("one bad step")
    outputs = core.step()
    assert [o.finish_reason for o in outputs] == ["error"]
    core.check_health()
    core.shutdown()
