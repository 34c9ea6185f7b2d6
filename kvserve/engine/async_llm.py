"""AsyncLLM: one engine loop on a background thread, fed by many asyncio requests.

The EngineCore and the OutputProcessor are touched only by the engine thread.
Coroutines talk to it through a thread-safe command queue; the thread answers
each request through that request's stream, always via
`loop.call_soon_threadsafe`, so no asyncio object is touched off its loop.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kvserve.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.kv_view import EngineKVView, PrefixCacheTotals
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestOutput
from kvserve.errors import EngineDeadError, EngineOverloadedError
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.speculation import SpecDecodingStats

logger = logging.getLogger(__name__)

@dataclass
class _AddCommand:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int


@dataclass
class _AbortCommand:
    request_ids: list[str]


@dataclass
class _ShutdownCommand:
    pass


@dataclass
class _KVViewCommand:
    """Take an `EngineKVView` on the engine thread and resolve `result` with it."""

    result: concurrent.futures.Future


# Delivered to a request's stream when someone else aborted it: the stream ends.
_ABORTED = object()


class _RequestStream:
    """Where the engine thread delivers one request's outputs.

    A consumer that falls behind does not pile up outputs: a new RequestOutput
    replaces an undelivered one (both are cumulative) and the per-step deltas
    (`new_text`, `new_token_ids`) are concatenated, so memory stays bounded.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: collections.deque = collections.deque()
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._put_on_loop, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    def _put_on_loop(self, item: Any) -> None:
        if self._pending and _is_request_output(item) and _is_request_output(self._pending[-1]):
            item = _merge_outputs(self._pending.pop(), item)
        self._pending.append(item)
        self._ready.set()

    async def get(self) -> Any:
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        return self._pending.popleft()


def _is_request_output(item: object) -> bool:
    return isinstance(item, RequestOutput)


def _merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` carrying the deltas of both steps (it is cumulative otherwise)."""
    older_by_index = {c.index: c for c in older.outputs}
    for completion in newer.outputs:
        previous = older_by_index.get(completion.index)
        if previous is not None:
            completion.new_text = previous.new_text + completion.new_text
            completion.new_token_ids = list(previous.new_token_ids) + list(completion.new_token_ids)
    return newer


class RequestHandle:
    """The consumer side of one submitted request: an async iterator of outputs.

    Iteration ends after the finished output, or quietly when someone else
    aborted the request; an engine failure is raised. `close()` before the end
    aborts the request; a handle dropped unclosed does the same.
    """

    def __init__(self, engine: "AsyncLLM", request_id: str, stream: _RequestStream) -> None:
        self.request_id = request_id
        self._engine = engine
        self._stream = stream
        self._done = False

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._stream.get()
        if item is _ABORTED:
            self._end(abort=False)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._end(abort=False)
            raise item
        if item.finished:
            self._end(abort=False)
        return item

    def close(self) -> None:
        """Abort the request unless it already ended; safe to call repeatedly."""
        if not self._done:
            self._end(abort=True)

    def _end(self, abort: bool) -> None:
        self._done = True
        self._engine._release(self.request_id, abort)  # noqa: SLF001 - the engine's own helper

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.close()


@dataclass
class EngineLoopStats:
    """What the engine loop has seen, cumulative since start; read by /metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_in_flight_requests: int = 0
    # Speculative decoding counters since start (None when it is off).
    spec_decoding: SpecDecodingStats | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class AsyncLLM:
    """Serve many concurrent asyncio requests from one EngineCore.

    `max_concurrent_requests` caps the requests in flight (running + waiting);
    `max_waiting_requests` caps those beyond the engine's `max_num_seqs`. Past
    either cap `reserve` / `add_request` raise `EngineOverloadedError` (HTTP
    503). `add_request` registers the request before returning, so a check and
    the submissions that follow it in the same loop step are exact.

    Engine and tokenizer parts may be injected (tests run the real EngineCore
    over `kvserve.testing.FakeExecutor`).
    """

    def __init__(self, engine_config: EngineConfig, *, max_concurrent_requests: int | None = None,
                 max_waiting_requests: int | None = None, engine_core: EngineCore | None = None,
                 tokenizer: Any = None, output_processor: OutputProcessor | None = None) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        if tokenizer is None:
            from kvserve.engine.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(self.model_config)
        self.tokenizer = tokenizer
        self.engine_core = engine_core or EngineCore(engine_config)
        self.output_processor = output_processor or OutputProcessor(tokenizer)
        self.validator = self.engine_core.validator
        self.max_model_len = self.validator.max_model_len
        self.max_concurrent_requests = max_concurrent_requests
        self.max_waiting_requests = max_waiting_requests
        self._max_num_seqs = engine_config.scheduler_config.max_num_seqs
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _RequestStream] = {}
        self._streams_lock = threading.Lock()
        # Requests in the output processor; touched by the engine thread only.
        self._live_request_ids: set[str] = set()
        self._stats = EngineLoopStats()
        self._dead_error: BaseException | None = None
        self._died = threading.Event()
        self._id_counter = itertools.count()
        self._thread = threading.Thread(target=self._run_loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    # ----- public API (event-loop side) -----

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead_error is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead_error

    def check_health(self) -> None:
        """Raise EngineDeadError (saying what died: a node and rank, where known) unless the
        engine can serve; asks the executor itself, so a rank lost while idle shows at once."""
        self._check_alive()
        self.engine_core.check_health()

    def wait_until_dead(self, timeout_s: float | None = None) -> bool:
        """Block until the engine loop has failed (True) or `timeout_s` passed (False); a
        shutdown asked for is no failure."""
        return self._died.wait(timeout_s)

    def num_in_flight_requests(self) -> int:
        with self._streams_lock:
            return len(self._streams)

    def get_stats(self) -> EngineLoopStats:
        """A snapshot of the engine loop's latest stats."""
        snapshot = EngineLoopStats(**vars(self._stats))
        if snapshot.spec_decoding is not None:
            snapshot.spec_decoding = copy.deepcopy(snapshot.spec_decoding)
        snapshot.num_in_flight_requests = self.num_in_flight_requests()
        return snapshot

    async def get_kv_view(self, timeout_s: float = 30.0) -> EngineKVView:
        """An `EngineKVView` taken by the engine thread between two steps."""
        self._check_alive()
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_KVViewCommand(result))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(result), timeout_s)
        except asyncio.TimeoutError:
            self._check_alive()
            raise

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt, exactly as `LLM.generate` tokenizes it."""
        return list(self.tokenizer.encode(prompt))

    def reserve(self, num_requests: int = 1) -> None:
        """Raise EngineOverloadedError if `num_requests` more would pass a cap.

        Admission is exact when the check and the `add_request` calls that
        follow run without an `await` in between (one event-loop step).
        """
        self._check_alive()
        in_flight = self.num_in_flight_requests() + num_requests
        if self.max_concurrent_requests is not None and in_flight > self.max_concurrent_requests:
            raise EngineOverloadedError(
                f"server busy: {self.max_concurrent_requests} requests already in flight")
        if self.max_waiting_requests is not None:
            if in_flight - self._max_num_seqs > self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"server busy: the waiting queue is full ({self.max_waiting_requests})")

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    check_capacity: bool = True) -> "RequestHandle":
        """Submit one request now; iterate the handle for its RequestOutputs.

        Must be called on the event loop that will consume the handle. Closing
        the handle (or dropping it) before the request finishes aborts it.
        """
        request_id = request_id or f"req-{next(self._id_counter)}"
        if check_capacity:
            self.reserve(1)
        else:
            self._check_alive()
        if isinstance(prompt, str):
            prompt_text, prompt_token_ids = prompt, self.encode(prompt)
        else:
            prompt_text, prompt_token_ids = None, prompt
        prompt_token_ids = self.validator.validate(prompt_token_ids, sampling_params, max_tokens_must_fit=True)
        stream = _RequestStream(asyncio.get_running_loop())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
        self._commands.put(_AddCommand(request_id, prompt_text, prompt_token_ids,
                                       sampling_params, time.monotonic(), priority))
        handle = RequestHandle(self, request_id, stream)
        if not self.is_running:  # the loop may have stopped while we registered
            handle.close()
            self._check_alive()
        return handle

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[Any]:
        """Yield RequestOutputs of one request until it finishes.

        Leaving the iteration early (a disconnect cancels it) aborts the request;
        an `abort(request_id)` from elsewhere ends the iteration quietly. A constraint
        that does not compile raises StructuredOutputError before the request is queued.
        """
        await self.validator.check_constraint_async(sampling_params.structured_outputs)
        handle = self.add_request(prompt, sampling_params, request_id, priority)
        try:
            async for output in handle:
                yield output
        finally:
            handle.close()

    def _release(self, request_id: str, abort: bool) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)
        if abort:
            self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort a request from any thread or coroutine; never blocks."""
        self._commands.put(_AbortCommand([request_id]))

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight, stop the engine loop and the engine core."""
        if self._thread.is_alive():
            self._commands.put(_ShutdownCommand())
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("engine loop did not stop within %.0f s", timeout_s)

    # ----- engine thread -----

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead_error}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine has stopped")

    def _run_loop(self) -> None:
        try:
            while True:
                busy = self.engine_core.has_unfinished_requests()
                if not self._apply_commands(block=not busy):
                    break
                if self.engine_core.has_unfinished_requests():
                    self._step()
                else:
                    self.engine_core.check_health()  # a rank may die or vanish while idle
                    self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - surfaced to every waiting request
            if isinstance(exc, EngineDeadError):
                logger.error("engine loop stopped: %s", exc)
            else:
                logger.exception("engine loop failed")
            self._dead_error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}"))
            self._died.set()
            self._drain_commands_after_death()
            return
        self._dead_error = EngineDeadError("the engine has been shut down")
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._shutdown_core()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False once shutdown is asked for."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _ShutdownCommand):
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _AddCommand | _AbortCommand | _KVViewCommand) -> None:
        if isinstance(command, _AbortCommand):
            self._abort_in_engine(command.request_ids)
            return
        if isinstance(command, _KVViewCommand):
            self._take_kv_view(command.result)
            return
        try:
            self._add_to_engine(command)
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the loop
            logger.info("request %s rejected: %s", command.request_id, exc)
            self._abort_in_engine([command.request_id], notify=False)
            self._deliver(command.request_id, exc)

    def _add_to_engine(self, command: _AddCommand) -> None:
        child_requests = self.output_processor.add_request(
            command.request_id, command.prompt, command.prompt_token_ids,
            command.sampling_params, command.arrival_time, priority=command.priority)
        self._live_request_ids.add(command.request_id)
        for child in child_requests:
            self.engine_core.add_request(child)

    def _abort_in_engine(self, request_ids: list[str], notify: bool = True) -> None:
        """Drop the requests from the engine; `notify` ends their streams quietly (an abort
        from elsewhere), otherwise the caller delivers why."""
        engine_ids = []
        for request_id in request_ids:
            engine_ids.extend(self.output_processor.abort_request(request_id))
            self._live_request_ids.discard(request_id)
            if notify:
                self._deliver(request_id, _ABORTED)
        if engine_ids:
            self.engine_core.abort_requests(engine_ids)

    def _take_kv_view(self, result: concurrent.futures.Future) -> None:
        try:
            self._refresh_stats()
            totals = PrefixCacheTotals(self._stats.prefix_cache_queries, self._stats.prefix_cache_hits)
            result.set_result(self.engine_core.get_kv_view(totals))
        except Exception as exc:  # noqa: BLE001 - the caller gets the error, the loop goes on
            result.set_exception(exc)

    def _step(self) -> None:
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.request_ids_to_abort:
            self.engine_core.abort_requests(list(processed.request_ids_to_abort))
        for request_output in processed.request_outputs:
            if request_output.finished:
                self._live_request_ids.discard(request_output.request_id)
            self._deliver(request_output.request_id, request_output)
        self._stats.num_steps += 1
        self._refresh_stats()

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)

    def _refresh_stats(self) -> None:
        stats = self.engine_core.get_stats()
        own = self._stats
        own.num_running_reqs = stats.num_running_reqs
        own.num_waiting_reqs = stats.num_waiting_reqs
        own.kv_cache_usage = stats.kv_cache_usage
        # The scheduler reports prefix-cache lookups since its previous snapshot.
        own.prefix_cache_queries += stats.prefix_cache_queries
        own.prefix_cache_hits += stats.prefix_cache_hits
        own.num_preemptions = stats.num_preemptions
        spec = stats.spec_decoding_stats
        if spec is not None:
            own.spec_decoding = own.spec_decoding or SpecDecodingStats()
            own.spec_decoding.add(spec)

    def _fail_all(self, error: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)

    def _drain_commands_after_death(self) -> None:
        while True:
            try:
                command = self._commands.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(command, _ShutdownCommand):
                self._shutdown_core()
                return
            if isinstance(command, _AddCommand):
                self._deliver(command.request_id, EngineDeadError("the engine has stopped"))
            elif isinstance(command, _KVViewCommand):
                command.result.set_exception(EngineDeadError("the engine has stopped"))

    def _shutdown_core(self) -> None:
        try:
            if self._live_request_ids:
                self._abort_in_engine(list(self._live_request_ids))
            self.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            logger.exception("error while shutting the engine core down")
