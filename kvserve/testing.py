"""Public helpers to drive the scheduler without a model (like `torch.testing`).

`create_scheduler` builds a `Scheduler` over a synthetic KV-cache layout,
`create_requests` makes requests with ids "0", "1", ..., and
`FakeModelRunner` turns a `SchedulerOutput` into a `ModelRunnerOutput` with
deterministic tokens, keeping per-request state the way a real runner does
(all three live in `kvserve.planner.simulated`, the runner the planner drives),
`FakeExecutor` puts it behind the `Executor` interface, and `StepDriver` runs
the real `EngineCore` loop (sync, or async with one step in flight) over a
scheduler and a fake executor. Imports no torch.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from kvserve.engine.core import EngineCore
from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from kvserve.model.config import ModelConfig
from kvserve.request import Request
from kvserve.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvserve.scheduler.scheduler import Scheduler
from kvserve.worker.executor import Executor, ExecutorDeadError
from kvserve.planner.simulated import FakeModelRunner, create_requests, create_scheduler

__all__ = ["FakeModelRunner", "create_requests", "create_scheduler", "RequestResult", "FakeExecutor",
           "fake_engine_config", "StepDriver", "assert_pool_whole"]


@dataclass
class RequestResult:
    """Everything the engine was told about one request."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class FakeExecutor(Executor):
    """A `FakeModelRunner` behind the `Executor` interface, for the real `EngineCore`.

    Steps run on the calling thread (the runner works one step ahead, so the
    engine's async pipelining still applies), after `step_delay_s`. With an
    `EngineConfig`, the KV pool has one full-attention layer of the configured
    block size and `num_blocks` blocks. A step that raises kills the executor
    (`check_health` then raises with the step's error), so the engine reports
    it as dead; `fail_next_step` injects such an error. `error_next_step`
    makes the next step raise while the executor stays healthy (the engine
    finishes that step's requests with "error" and goes on). `kill` makes it
    die as a tensor-parallel executor does when it loses a rank, at a chosen
    point: in a health check, when the next step is submitted, or when its
    result is collected.
    """

    def __init__(self, engine_config: EngineConfig | None = None, runner: FakeModelRunner | None = None,
                 num_blocks: int = 512, step_delay_s: float = 0.0,
                 kv_cache_specs: dict[str, KVCacheSpec] | None = None) -> None:
        super().__init__(engine_config)  # type: ignore[arg-type]
        self.runner = runner or FakeModelRunner()
        self.num_blocks = num_blocks
        block_size = engine_config.cache_config.block_size if engine_config else 16
        self.kv_cache_specs = kv_cache_specs or {
            "layer0": FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")}
        self.step_delay_s = step_delay_s
        self.fail_next_step: Exception | None = None
        self.error_next_step: Exception | None = None
        self.step_thread_ids: set[int] = set()
        # Called with each scheduler output as it is submitted (before it runs).
        self.on_submit: Callable[[SchedulerOutput], None] | None = None
        self._dead_error: BaseException | None = None
        self._death: tuple[str, str] | None = None  # (when, reason) of a `kill` still to come

    def kill(self, reason: str, when: str = "now") -> None:
        """Die with `reason`: "now" (the next `check_health` raises, as after a heartbeat
        found a rank gone while idle), "submit" (the next step's submission raises) or
        "collect" (the next step is accepted, then its future fails with the death)."""
        if when not in ("now", "submit", "collect"):
            raise ValueError(f"when must be 'now', 'submit' or 'collect', got {when!r}")
        with self._lock:
            if when == "now":
                self._dead_error = ExecutorDeadError(reason)
            else:
                self._death = (when, reason)

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return dict(self.kv_cache_specs)

    def determine_available_memory(self) -> int:
        return self.num_blocks * sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        with self._lock:
            self._die_if_due("submit")
            self.check_health()
            self.step_thread_ids.add(threading.get_ident())
            if self.on_submit is not None:
                self.on_submit(scheduler_output)
            future: Future[ModelRunnerOutput] = Future()
            if self._death is not None and self._death[0] == "collect":
                self._die_if_due("collect")
                future.set_exception(self._dead_error)
                return future
            if self.error_next_step is not None:  # fails once the runner state moved, as a kernel would
                error, self.error_next_step = self.error_next_step, None
                self.runner.execute(scheduler_output)
                future.set_exception(error)
                return future
            try:
                if self.fail_next_step is not None:
                    error, self.fail_next_step = self.fail_next_step, None
                    raise error
                if self.step_delay_s:
                    time.sleep(self.step_delay_s)
                future.set_result(self.runner.execute(scheduler_output))
            except Exception as exc:  # noqa: BLE001 - delivered through the future, as a real step would
                self._dead_error = exc
                future.set_exception(exc)
            return future

    def _die_if_due(self, point: str) -> None:
        if self._death is not None and self._death[0] == point:
            self._dead_error = ExecutorDeadError(self._death[1])
            self._death = None

    def check_health(self) -> None:
        self._raise_if_shut_down()
        if isinstance(self._dead_error, ExecutorDeadError):
            raise ExecutorDeadError(str(self._dead_error))
        if self._dead_error is not None:
            raise ExecutorDeadError(f"{type(self._dead_error).__name__}: {self._dead_error}")

    def _stop_runners(self) -> None:
        pass


def fake_engine_config(max_model_len: int = 256, vocab_size: int = 49152, eos_token_ids: Sequence[int] = (),
                       cache_config: CacheConfig | None = None, scheduler_config: SchedulerConfig | None = None,
                       **engine_kwargs: Any) -> EngineConfig:
    """A real EngineConfig naming a model no one loads, for an EngineCore over a `FakeExecutor`."""
    model_config = ModelConfig(
        path="/models/fake-model", is_gguf=False, architecture="LlamaForCausalLM", model_type="llama",
        family="llama", num_layers=1, hidden_size=8, intermediate_size=16, num_heads=1, num_kv_heads=1,
        head_dim=8, vocab_size=vocab_size, max_position_embeddings=max_model_len,
        max_model_len=max_model_len, eos_token_ids=list(eos_token_ids))
    return EngineConfig(model_config, cache_config or CacheConfig(),
                        scheduler_config or SchedulerConfig(max_model_len=max_model_len),
                        ParallelConfig(), device="cpu", **engine_kwargs)


class StepDriver:
    """The real `EngineCore` loop over a scheduler and a `FakeModelRunner`.

    Requests go to the scheduler as they are (tests keep the `Request`
    objects); `step()` is `EngineCore.step()`, and `schedule_step()` /
    `process_step()` are its two halves for tests that interleave checks.
    Async (`async_steps`): at most two steps are unprocessed; outputs are
    applied in step order. A runner error (a broken invariant) raises.
    """

    def __init__(self, scheduler: Scheduler, runner: FakeModelRunner, async_steps: bool = False) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.executor = FakeExecutor(runner=runner)
        self.executor.on_submit = self._on_submit
        self.core = EngineCore.from_parts(scheduler, self.executor, runner.vocab_size)
        self.core.async_scheduling = async_steps
        self.results: dict[str, RequestResult] = {}
        self.scheduler_outputs: list[SchedulerOutput] = []
        # Steps that scheduled a request whose previous step was still unprocessed.
        self.num_steps_scheduled_ahead = 0

    def _on_submit(self, scheduler_output: SchedulerOutput) -> None:
        in_flight_req_ids = {req_id for out, _ in self.in_flight for req_id in out.num_scheduled_tokens}
        if in_flight_req_ids & scheduler_output.num_scheduled_tokens.keys():
            self.num_steps_scheduled_ahead += 1
        self.scheduler_outputs.append(scheduler_output)

    @property
    def in_flight(self) -> deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]]:
        return self.core.steps_in_flight

    def add_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.results.setdefault(request.request_id, RequestResult())
            self.scheduler.add_request(request)

    def schedule_step(self) -> SchedulerOutput:
        return self.core.schedule_step()

    def process_step(self) -> list[EngineCoreOutput]:
        return self._record_all(self.core.process_step())

    def _record_all(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for output in outputs:
            self.record(output)
        return outputs

    def record(self, output: EngineCoreOutput) -> None:
        result = self.results.setdefault(output.request_id, RequestResult())
        result.token_ids.extend(output.new_token_ids)
        result.logprobs.extend(output.new_logprobs or [])
        if output.finished:
            result.finish_reason = output.finish_reason
            result.stop_reason = output.stop_reason

    def step(self) -> None:
        """One engine iteration (`EngineCore.step()`)."""
        self._record_all(self.core.step())

    def is_done(self) -> bool:
        return not self.in_flight and not self.scheduler.has_unfinished_requests()

    def run(self, max_steps: int = 100_000) -> dict[str, RequestResult]:
        """Step until every request finished and no step is in flight."""
        for _ in range(max_steps):
            if self.is_done():
                return self.results
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_pool_whole(scheduler: Scheduler) -> None:
    """Every request gone, every fence drained, every block back in its pool."""
    pool = scheduler.kv_cache_manager.block_pool
    assert not scheduler.requests
    assert not scheduler.running and not scheduler.waiting
    assert not scheduler.deferred_frees
    assert pool.get_num_free_blocks() == scheduler.kv_cache_config.num_blocks - 1
    if pool.state_pool is not None:
        assert pool.state_pool.get_num_free_blocks() == scheduler.kv_cache_config.num_state_blocks - 1
    pool.check_invariants()
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not any(manager.req_to_blocks.values())


class FakeBenchRunner:
    """A benchmark runner (`run(workload) -> ThroughputResult`) that computes nothing, for the
    compare harness's tests; it can kill its own process as a crashing reference would:
    `crash_signal` ("SIGSEGV") at load (`crash_on_load`, unless `extra_buffers` is False, as
    llama.cpp's repacked buffers do) or on its `crash_on_run`-th run (1-based)."""

    def __init__(self, engine: str, seconds_per_run: float = 0.001, crash_signal: str | None = None,
                 crash_on_run: int | None = None, crash_on_load: bool = False, extra_buffers: bool = True) -> None:
        self.engine = engine
        self.seconds_per_run = seconds_per_run
        self.crash_signal = crash_signal
        self.crash_on_run = crash_on_run
        self.num_runs = 0
        self.load_s = 0.0
        if crash_on_load and extra_buffers:
            self._crash()

    def _crash(self) -> None:
        import os
        import signal
        os.kill(os.getpid(), getattr(signal, self.crash_signal or "SIGSEGV"))
        time.sleep(60)  # a handled or blocked signal must not look like a clean run

    def run(self, workload):
        from kvserve.bench.references import ThroughputResult

        self.num_runs += 1
        if self.num_runs == self.crash_on_run:
            self._crash()
        time.sleep(self.seconds_per_run)
        return ThroughputResult(self.engine, workload.name, len(workload.requests), workload.num_prompt_tokens,
                                workload.num_output_tokens, self.seconds_per_run, self.load_s)
