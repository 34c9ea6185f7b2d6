"""EngineCore: the schedule -> execute -> update loop over one executor.

With async scheduling (the default) the core keeps one model step in flight
on the executor while it schedules the next one: step N+1 is planned before
step N's tokens are known (the scheduler gives such requests an output
placeholder and fences block frees on step sequence numbers), and outputs
are always applied in step order. Without it, each step is scheduled,
executed and applied before the next. Both give the same greedy tokens.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.engine.kv_events import ZmqEventPublisher, create_publisher
from kvserve.engine.kv_view import EngineKVView, PrefixCacheTotals, StepTimeline, build_kv_view
from kvserve.engine.validation import RequestValidator
from kvserve.errors import EngineDeadError, InvalidRequestError
from kvserve.kv_cache.events import KVEventRecorder
from kvserve.kv_cache.interface import KVCacheConfig
from kvserve.kv_cache.layout import StatePoolSizing, budget_split
from kvserve.kv_cache.utils import get_kv_cache_config
from kvserve.model.config import ModelConfig
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from kvserve.scheduler.scheduler import Scheduler
from kvserve.scheduler.stats import SchedulerStats
from kvserve.worker.executor import Executor, ExecutorDeadError, UniProcExecutor

logger = logging.getLogger(__name__)
# The start-up line that says what the KV pool took and why; the CLI shows it.
kv_size_logger = logging.getLogger("kvserve.kv_cache_size")

# Steps submitted to the executor and not yet applied under async scheduling:
# the one executing and the one scheduled ahead of it.
MAX_STEPS_IN_FLIGHT = 2
# Under async scheduling, steps are scheduled ahead for this many running requests or more
# even where the engine's own work cannot overlap the model step (see `max_steps_in_flight`).
SCHEDULE_AHEAD_MIN_REQUESTS = 2
# Consecutive steps that schedule nothing, with nothing in flight, while requests
# are unfinished: the scheduler is stuck, and callers looping on step() would hang.
MAX_STALLED_STEPS = 1000


@dataclass
class EngineCoreRequest:
    """A tokenized request as the front-end hands it to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float | None = None
    priority: int = 0
    cache_salt: str | None = None


def default_executor_class(engine_config: EngineConfig) -> type[Executor]:
    """One runner in this process, or `-tp N` ranks in their own processes."""
    if engine_config.parallel_config.tensor_parallel_size == 1:
        return UniProcExecutor
    from kvserve.worker.tp_executor import TPExecutor  # imports the rank workers, and torch
    return TPExecutor


class EngineCore:
    """Owns the scheduler and the executor; `step()` advances every request by one step."""

    def __init__(self, engine_config: EngineConfig,
                 executor_class: Callable[[EngineConfig], Executor] | None = None) -> None:
        self.engine_config = engine_config
        executor = (executor_class or default_executor_class(engine_config))(engine_config)
        try:
            kv_cache_config = _initialize_kv_cache(engine_config, executor)
            scheduler = Scheduler(engine_config.scheduler_config, kv_cache_config, engine_config.cache_config)
            kv_event_publisher = create_publisher(engine_config.kv_events_config)
        except BaseException:
            executor.shutdown()
            raise
        model_config = engine_config.model_config
        self._start(scheduler, executor, model_config.vocab_size, model_config.eos_token_ids, kv_event_publisher,
                    model_config=model_config)

    @classmethod
    def from_parts(cls, scheduler: Scheduler, executor: Executor, vocab_size: int,
                   eos_token_ids: Sequence[int] = ()) -> "EngineCore":
        """The same loop over a scheduler and an executor built elsewhere (tests, tools);
        `engine_config` is None. Async scheduling follows the scheduler's config."""
        core = cls.__new__(cls)
        core.engine_config = None  # type: ignore[assignment]
        core._start(scheduler, executor, vocab_size, eos_token_ids)
        return core

    def _start(self, scheduler: Scheduler, executor: Executor, vocab_size: int,
               eos_token_ids: Sequence[int], kv_event_publisher: ZmqEventPublisher | None = None,
               model_config: ModelConfig | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.kv_event_publisher = kv_event_publisher
        self.kv_cache_config = scheduler.kv_cache_config
        self.model_eos_token_ids = list(eos_token_ids or [])
        # The scheduler picks the hash unit (it may be finer than a block, for
        # partial-block hits); requests hash their tokens with its hasher.
        self.request_block_hasher = scheduler.block_hasher
        self.validator = RequestValidator(scheduler.scheduler_config.max_model_len, vocab_size,
                                          scheduler.max_tokens_in_pool, model_config)
        self.async_scheduling = scheduler.scheduler_config.async_scheduling
        # Under async scheduling: None lets `max_steps_in_flight` decide per step; True
        # always schedules a step ahead, False never (benchmarks and tests set it).
        self.schedule_ahead: bool | None = None
        # Steps submitted to the executor and not yet applied, oldest first.
        self.steps_in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        self._is_dead: str | None = None
        self._num_stalled_steps = 0
        self.step_timeline = StepTimeline()
        if self.kv_event_publisher is not None:
            self.scheduler.kv_cache_manager.block_pool.kv_events = KVEventRecorder()

    # ---- requests -----------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; raises InvalidRequestError (a ValueError) for one the engine can never serve."""
        self._check_alive()
        prompt = self.validator.validate(request.prompt_token_ids, request.sampling_params)
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", "request_id")
        eos_token_id, sampling_params = self._eos_and_stop_ids(request)
        self.scheduler.add_request(Request(
            request.request_id, prompt, sampling_params, eos_token_id=eos_token_id,
            arrival_time=request.arrival_time if request.arrival_time is not None else time.monotonic(),
            priority=request.priority, block_hasher=self.request_block_hasher,
            cache_salt=request.cache_salt))

    def _eos_and_stop_ids(self, request: EngineCoreRequest) -> tuple[int | None, SamplingParams]:
        """The request's EOS id; a model's further EOS ids become stop token ids."""
        model_eos_ids = self.model_eos_token_ids
        eos_token_id = request.eos_token_id
        if eos_token_id is None and model_eos_ids:
            eos_token_id = model_eos_ids[0]
        params = request.sampling_params
        extra_eos_ids = [t for t in model_eos_ids
                         if t != eos_token_id and t not in params.stop_token_ids]
        if extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra_eos_ids)
        return eos_token_id, params

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.steps_in_flight)

    # ---- the loop -------------------------------------------------------------

    @property
    def max_steps_in_flight(self) -> int:
        """Two under async scheduling (the step executing and the one scheduled ahead of it),
        one without. A single stream on an executor whose model step keeps every CPU core
        busy also runs one step at a time: the engine's work on the step ahead would take a
        core from the step itself (whose threads then wait at their barriers) and hide
        nothing, while waiting for each step as it is submitted lets the executor run it on
        this thread, without two thread hand-offs per token (`Executor.inline_steps`)."""
        if not self.async_scheduling or self.schedule_ahead is False:
            return 1
        if (self.schedule_ahead or len(self.scheduler.running) >= SCHEDULE_AHEAD_MIN_REQUESTS
                or self.executor.spare_cpu_for_host_work):
            return MAX_STEPS_IN_FLIGHT
        return 1

    def step(self) -> list[EngineCoreOutput]:
        """Advance by one step and return what it produced (possibly nothing).

        With async scheduling, step N+1 is scheduled and submitted while step N
        executes, then step N's output is applied; without it, each step is
        scheduled, executed and applied before the next.
        """
        self._check_alive()
        if len(self.steps_in_flight) < self.max_steps_in_flight and self.scheduler.has_unfinished_requests():
            scheduler_output = self.schedule_step()
            if not scheduler_output.is_empty and len(self.steps_in_flight) < self.max_steps_in_flight:
                return []
        if not self.steps_in_flight:
            return []
        return self.process_step()

    def schedule_step(self) -> SchedulerOutput:
        """The first half of a step: schedule and submit it to the executor."""
        scheduler_output = self.scheduler.schedule()
        self.step_timeline.start(scheduler_output.step_seq)
        # With one step in flight at most, `step()` waits for this one right away.
        self.executor.inline_steps = self.max_steps_in_flight == 1
        try:
            future = self.executor.execute_model_async(scheduler_output)
        except ExecutorDeadError as exc:  # found dead as the step was handed over
            raise self._executor_died(exc) from exc
        self.steps_in_flight.append((scheduler_output, future))
        return scheduler_output

    def process_step(self) -> list[EngineCoreOutput]:
        """The second half of the oldest step in flight: wait for it and apply its output."""
        scheduler_output, future = self.steps_in_flight.popleft()
        try:
            model_runner_output = future.result()
        except Exception as exc:  # a failed step fails its requests, not the engine
            return self._fail_step(scheduler_output, exc)
        outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        self.step_timeline.finish(scheduler_output.step_seq, scheduler_output.total_num_scheduled_tokens,
                                  len(scheduler_output.num_scheduled_tokens))
        self._publish_kv_events()
        self._check_progress(scheduler_output, outputs)
        return outputs

    def _check_progress(self, scheduler_output: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        if (outputs or not scheduler_output.is_empty or self.steps_in_flight
                or not self.scheduler.has_unfinished_requests()):
            self._num_stalled_steps = 0
            return
        self._num_stalled_steps += 1
        if self._num_stalled_steps >= MAX_STALLED_STEPS:
            self._is_dead = (f"the scheduler scheduled nothing in {MAX_STALLED_STEPS} steps while "
                             f"{self.scheduler.get_num_unfinished_requests()} requests are unfinished "
                             f"({self.scheduler.make_stats()})")
            raise EngineDeadError(self._is_dead)

    def _fail_step(self, scheduler_output: SchedulerOutput, exc: Exception) -> list[EngineCoreOutput]:
        logger.error("model step %d failed: %r", scheduler_output.step_seq, exc,
                     exc_info=(type(exc), exc, exc.__traceback__))
        if isinstance(exc, ExecutorDeadError):
            raise self._executor_died(exc) from exc
        try:
            self.executor.check_health()
        except Exception as dead:
            raise self._executor_died(dead) from exc
        req_ids = list(scheduler_output.num_scheduled_tokens)
        finished = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR) or []
        # Apply an output with no tokens so the step's fence is processed and its frees
        # drain; it may still carry other requests' outputs (ignored prompts).
        outputs = self.scheduler.update_from_output(
            scheduler_output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids]))
        reason = f"model step failed: {type(exc).__name__}: {exc}"
        return outputs + [EngineCoreOutput(request.request_id, [], finish_reason="error", stop_reason=reason)
                          for request in finished]

    def _check_alive(self) -> None:
        if self._is_dead:
            raise EngineDeadError(self._is_dead)

    def check_health(self) -> None:
        """Raise EngineDeadError when no more steps can run, e.g. the executor died while idle
        (the message names the node and rank it lost). Safe to call from any thread."""
        self._check_alive()
        try:
            self.executor.check_health()
        except ExecutorDeadError as exc:
            raise self._executor_died(exc) from exc

    def _executor_died(self, exc: BaseException) -> EngineDeadError:
        """The error for a dead executor, found at submit, at collect or in a health check;
        every later call raises it too."""
        self._is_dead = self._is_dead or f"the executor died: {exc}"
        return EngineDeadError(self._is_dead)

    # ---- misc -----------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_kv_view(self, prefix_cache: PrefixCacheTotals) -> EngineKVView:
        """The KV cache, queues and recent steps now (`prefix_cache`: the caller's totals)."""
        return build_kv_view(self.scheduler, self.step_timeline, prefix_cache)

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def _publish_kv_events(self) -> None:
        """One batch per step of what the block pool stored, evicted or cleared."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.scheduler.kv_cache_manager.block_pool.kv_events.take())

    def shutdown(self) -> None:
        """Finish the steps in flight (their outputs are dropped) and stop the executor."""
        while self.steps_in_flight:
            _, future = self.steps_in_flight.popleft()
            future.cancel()
        self.executor.shutdown()
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
            self.kv_event_publisher.shutdown()

    def __enter__(self) -> "EngineCore":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


def _initialize_kv_cache(engine_config: EngineConfig, executor: Executor) -> KVCacheConfig:
    """Size the KV pool from the executor's layer specs and memory, and have it allocated."""
    available_bytes = executor.determine_available_memory()
    scheduler_config = engine_config.scheduler_config
    sizing = StatePoolSizing(max_num_seqs=scheduler_config.max_num_seqs,
                             max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
                             enable_caching=engine_config.cache_config.enable_prefix_caching,
                             max_model_len=engine_config.max_model_len)
    kv_cache_config = get_kv_cache_config(executor.get_kv_cache_specs(), available_bytes,
                                          state_pool_sizing=sizing)
    block_size = engine_config.cache_config.block_size
    capacity_tokens = (kv_cache_config.num_blocks - 1) * block_size
    kv_size_logger.info("KV cache: %d blocks, %.0f MiB (%s; %d-token blocks, %d groups)",
                        kv_cache_config.num_blocks,
                        sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors) / 2**20,
                        executor.kv_memory_note or "as the executor gave it", block_size,
                        len(kv_cache_config.kv_cache_groups))
    shares = budget_split(kv_cache_config)
    if len(shares) > 1:
        logger.info("KV budget split: %s", "; ".join(
            f"{share.kind} pool {share.num_blocks} blocks, {share.num_bytes / 2**20:.1f} MiB "
            f"({100 * share.num_bytes / max(available_bytes, 1):.1f}%)" for share in shares))
    if capacity_tokens < engine_config.max_model_len:
        logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: "
                       "longer requests cannot run", capacity_tokens, engine_config.max_model_len)
    executor.initialize_kv_cache(kv_cache_config)
    return kv_cache_config
