"""Executors: how the engine reaches the model runner(s).

The engine talks to an `Executor` only through `SchedulerOutput` ->
`ModelRunnerOutput`. `UniProcExecutor` runs one `ModelRunner` in this process
on a single worker thread, so `execute_model_async` lets the engine schedule
step N+1 while step N runs (torch releases the GIL inside its kernels). A
multi-process tensor-parallel executor (`tp_executor.TPExecutor`) plugs in behind
the same interface; the engine picks the class from
`parallel_config.tensor_parallel_size` (`kvserve.engine.core.default_executor_class`).
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvserve.kv_cache.interface import KVCacheConfig, KVCacheSpec
from kvserve.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

logger = logging.getLogger(__name__)


class ExecutorDeadError(RuntimeError):
    """The executor can no longer run steps (a worker died or it was shut down)."""


class Executor:
    """Runs model steps for the engine; subclasses decide where the runners live.

    Lifecycle: `get_kv_cache_specs()` and `determine_available_memory()` (the
    engine turns them into a `KVCacheConfig`), `initialize_kv_cache(config)`,
    then `execute_model[_async](scheduler_output)` once per step, in step
    order, and `shutdown()`.
    """

    def __init__(self, engine_config: "EngineConfig") -> None:
        self.engine_config = engine_config
        self._lock = threading.RLock()
        self._is_shut_down = False
        # Set by the engine while it waits for each step as soon as it submits it: an
        # executor may then run the step on the calling thread (see UniProcExecutor).
        self.inline_steps = False

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        raise NotImplementedError

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may use (the minimum over all ranks)."""
        raise NotImplementedError

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        raise NotImplementedError

    @property
    def kv_memory_note(self) -> str | None:
        """Why `determine_available_memory` gave its size (the start-up log line); None: not known."""
        return None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its output."""
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise ExecutorDeadError when steps can no longer run."""
        raise NotImplementedError

    @property
    def spare_cpu_for_host_work(self) -> bool:
        """Whether the engine's own Python work (scheduling, outputs) runs beside a model
        step without taking a core from it; True unless an executor knows better."""
        return True

    def shutdown(self) -> None:
        """Stop the runners, once; later steps raise ExecutorDeadError."""
        with self._lock:
            if self._is_shut_down:
                return
            self._is_shut_down = True
        self._stop_runners()

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    def _stop_runners(self) -> None:
        raise NotImplementedError

    def _raise_if_shut_down(self) -> None:
        if self._is_shut_down:
            raise ExecutorDeadError("the executor has been shut down")


class UniProcExecutor(Executor):
    """One ModelRunner in this process; async steps run on one worker thread, in order."""

    def __init__(self, engine_config: "EngineConfig") -> None:
        super().__init__(engine_config)
        from kvserve.worker.model_runner import ModelRunner

        self.model_runner = ModelRunner(
            engine_config.model_config, engine_config.cache_config, engine_config.device,
            scheduler_config=engine_config.scheduler_config, seed=engine_config.seed,
            kernel_config=engine_config.kernel_config, draft_model_config=engine_config.draft_model_config)
        self.model_runner.load_model()
        # One thread: steps must run in submission order on the runner's state.
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        self._last_submitted: Future[ModelRunnerOutput] | None = None
        self._usable_cpus = _usable_cpu_count()

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_specs()

    def determine_available_memory(self) -> int:
        return self.model_runner.available_kv_memory_bytes()

    @property
    def kv_memory_note(self) -> str | None:
        return self.model_runner.kv_memory_note

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        """The step's output to come. With `inline_steps`, and no earlier step still on the
        step thread, the step runs here, on the calling thread, and the future is done on
        return: the caller waits for it at once anyway, and handing the step to a thread
        and back costs two wake-ups (tens of microseconds quiet, milliseconds under load)."""
        with self._lock:
            self.check_health()
            if self.inline_steps and (self._last_submitted is None or self._last_submitted.done()):
                return _run_inline(self.model_runner.execute_model, scheduler_output)
            self._last_submitted = self._step_thread.submit(self.model_runner.execute_model, scheduler_output)
            return self._last_submitted

    def check_health(self) -> None:
        self._raise_if_shut_down()

    @property
    def spare_cpu_for_host_work(self) -> bool:
        """On the CPU, whether this process may use more cores than the model step's
        threads keep busy; always on a GPU."""
        runner = self.model_runner
        return runner.device.type != "cpu" or self._usable_cpus > runner.num_step_threads

    def _stop_runners(self) -> None:
        self._step_thread.shutdown(wait=True, cancel_futures=True)


def _run_inline(fn, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
    """`fn(scheduler_output)` run now, as a done future (its exception set on it, as a
    worker thread would)."""
    future: Future[ModelRunnerOutput] = Future()
    try:
        future.set_result(fn(scheduler_output))
    except Exception as exc:  # noqa: BLE001 - the engine fails the step's requests
        future.set_exception(exc)
    return future


def _usable_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
