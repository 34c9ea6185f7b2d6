"""TPExecutor: a tensor-parallel group of worker processes behind the Executor interface.

Layout: the engine process runs the scheduler and this executor only; all
`tensor_parallel_size` ranks, rank 0 (the driver) included, are worker
processes started with the `torch.multiprocessing` spawn context. Keeping
the engine process out of the collectives means a dead or stuck rank can
never block it inside torch.distributed: it only ever waits on pipes and
process sentinels, so a worker's death is seen at once and reported as
`ExecutorDeadError`.

Every call (set-up or model step) is pickled to each rank over its own pipe,
in submission order; each rank answers each call once, in order. A step's
`SchedulerOutput` thus reaches every rank (its CoW copies included), and
the driver's answer carries the `ModelRunnerOutput`. A receiver thread pairs
the answers with the callers' futures, so `execute_model_async` returns at
once and the engine can schedule the next step while this one runs.

Heartbeats (across nodes): a rank on this node that dies is seen at once
(its process exits), a remote rank that dies closes its connection; but a
node that is stopped (SIGSTOP) or cut off by the network says nothing. So
while no call is pending the receiver sends every rank a `Heartbeat` each
T/4 seconds (T: `heartbeat_timeout_s`, `--heartbeat-timeout`) and declares a
rank lost when it has not answered T/2 seconds after it was sent. Checking
every T/8 seconds, loss is found at most T/4 + T/8 (the next heartbeat
leaves) + T/2 + T/8 (the deadline is checked) = T seconds after the last
answer. A step in flight is not bounded (a long prefill is no failure).

gloo on CPU, NCCL on CUDA: the backend string and the device are the only
differences between the two paths.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_for_ready
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

from kvserve.kv_cache.interface import KVCacheConfig, KVCacheSpec
from kvserve.messages import ModelRunnerOutput, SchedulerOutput
from kvserve.worker.executor import Executor, ExecutorDeadError
from kvserve.worker.multinode import NodeLayout, RemoteRankListener, cluster_identity, join_timeout_s
from kvserve.worker.tp_worker import (DRIVER_RANK, AvailableKVMemory, ExecuteModel, GetKVCacheSpecs, Heartbeat,
                                      InitializeKVCache, Shutdown, Startup, WorkerCall, WorkerInit, WorkerReply,
                                      distributed_backend, rank_device, worker_main)

if TYPE_CHECKING:
    from kvserve.config import EngineConfig
    from kvserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

# A rank stuck in a collective (a peer hung rather than died) gives up after this.
COLLECTIVE_TIMEOUT_S = 600.0
# How long shutdown waits for a worker to exit by itself before terminating it.
WORKER_EXIT_GRACE_S = 10.0
# How often an idle receiver looks at the workers' liveness.
IDLE_HEALTH_CHECK_S = 0.5


class WorkerStepError(RuntimeError):
    """A call failed on the workers (every rank alike); the message names the error, the log
    has its traceback."""


def threads_per_rank(world_size: int) -> int:
    """CPU threads for each rank: the cores this process may use, shared evenly."""
    try:
        num_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        num_cores = os.cpu_count() or 1
    return max(1, num_cores // world_size)


def check_model_splits(model_config: ModelConfig, tp_size: int) -> None:
    """Raise ConfigError, before any process starts, when the model cannot be split tp_size ways."""
    from kvserve.config import ConfigError

    problems = []
    if model_config.num_heads % tp_size:
        problems.append(f"{model_config.num_heads} attention heads")
    num_kv_heads = model_config.num_kv_heads
    if (num_kv_heads >= tp_size and num_kv_heads % tp_size) or (num_kv_heads < tp_size and tp_size % num_kv_heads):
        problems.append(f"{num_kv_heads} KV heads")
    intermediate_size = model_config.intermediate_size
    if intermediate_size % tp_size:
        problems.append(f"an MLP width of {intermediate_size}")
    # (The planner passes model shapes, which have no experts or Q/K norm.)
    expert_width = getattr(model_config, "moe_intermediate_size", 0)
    if expert_width % tp_size:
        problems.append(f"an expert width of {expert_width}")
    if tp_size > 1 and not getattr(model_config, "qk_norm_per_head", True):
        raise ConfigError(f"{model_config.architecture} normalizes Q and K over all heads, which tensor "
                          "parallelism does not support yet; run it with tensor_parallel_size 1")
    if problems:
        raise ConfigError(f"tensor_parallel_size {tp_size} does not divide the model's {' and '.join(problems)}; "
                          "it must divide the attention heads and the MLP width, and divide or be a multiple of the KV heads")


def check_devices(device: str, tp_size: int) -> None:
    """Raise ConfigError when a CUDA run has fewer visible GPUs than ranks need."""
    if not device.startswith("cuda"):
        return
    import torch

    from kvserve.config import ConfigError

    last_needed = rank_device(device, tp_size - 1)
    available = torch.cuda.device_count()
    if int(last_needed.split(":")[1]) >= available:
        raise ConfigError(f"tensor_parallel_size {tp_size} on {device} needs GPUs up to {last_needed}, "
                          f"but {available} are visible (one GPU per rank)")


def worker_init(engine_config, rank: int, local_rank: int, init_method: str, num_threads: int,
                collective_timeout_s: float) -> WorkerInit:
    """The WorkerInit of global `rank`, the `local_rank`-th on its node (which picks its GPU)."""
    return WorkerInit(
        rank=rank, world_size=engine_config.parallel_config.tensor_parallel_size,
        backend=distributed_backend(engine_config.device, engine_config.parallel_config.distributed_backend),
        init_method=init_method, device=rank_device(engine_config.device, local_rank),
        num_threads=num_threads, collective_timeout_s=collective_timeout_s)


class _PendingCall:
    """A call sent to every rank, waiting for their replies."""

    def __init__(self, call: WorkerCall) -> None:
        self.call = call
        self.future: Future = Future()
        self.replies: dict[int, WorkerReply] = {}
        self.sent_at = time.monotonic()


class TPExecutor(Executor):
    """Runs each step on `tensor_parallel_size` spawned worker processes (one per rank)."""

    def __init__(self, engine_config: "EngineConfig") -> None:
        super().__init__(engine_config)
        import torch.multiprocessing as torch_mp

        self.world_size = engine_config.parallel_config.tensor_parallel_size
        self.layout = NodeLayout.from_parallel_config(engine_config.parallel_config)
        if self.layout.node_rank != 0:
            from kvserve.config import ConfigError
            raise ConfigError(f"node rank {self.layout.node_rank} does not run the engine: start it with "
                              "`kvserve serve ... --headless` (only node 0 runs the engine and the server)")
        check_model_splits(engine_config.model_config, self.world_size)
        check_devices(engine_config.device, self.layout.ranks_per_node)
        self.backend = distributed_backend(engine_config.device,
                                           engine_config.parallel_config.distributed_backend)
        self._dead_reason: str | None = None
        self._pending: deque[_PendingCall] = deque()
        self._pending_changed = threading.Condition(self._lock)
        # Heartbeats only across nodes: on one node a rank's death is seen from its process.
        self._heartbeat_timeout_s = engine_config.parallel_config.heartbeat_timeout_s
        self._heartbeats = self.layout.nnodes > 1
        self._idle_poll_s = min(IDLE_HEALTH_CHECK_S, self._heartbeat_timeout_s / 8)
        self._last_answer_at = time.monotonic()
        self._rendezvous_dir = tempfile.mkdtemp(prefix="kvserve-tp-")
        weakref.finalize(self, shutil.rmtree, self._rendezvous_dir, True)
        # By rank; a remote rank (another node) has a connection but no local process.
        self._processes: list = []
        self._conns: list = []
        self._receiver = threading.Thread(target=self._receive_loop, name="kvserve-tp-receiver", daemon=True)
        listener = self._listener = None
        if self.layout.nnodes > 1:
            # Bound before any rank starts, so a port in use fails at once.
            listener = self._listener = RemoteRankListener(self.layout, cluster_identity(engine_config))
            init_method = self.layout.torch_init_method
        else:
            init_method = "file://" + os.path.join(self._rendezvous_dir, "rendezvous")
        try:
            context = torch_mp.get_context("spawn")
            for rank in self.layout.ranks_on(0):
                self._start_worker(context, rank, init_method)
            if listener is not None:
                self._join_remote_ranks(listener)
            self._receiver.start()
            self._call_all(Startup(), send=False)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks up (%s, %s)", self.world_size, self.backend, engine_config.device)

    def _start_worker(self, context, rank: int, init_method: str) -> None:
        init = worker_init(self.engine_config, rank, rank, init_method,
                           threads_per_rank(self.layout.ranks_per_node), COLLECTIVE_TIMEOUT_S)
        parent_conn, child_conn = context.Pipe(duplex=True)
        process = context.Process(target=worker_main, args=(self.engine_config, init, child_conn),
                                  name=f"kvserve-tp-rank{rank}", daemon=True)
        process.start()
        child_conn.close()
        self._processes.append(process)
        self._conns.append(parent_conn)

    def _join_remote_ranks(self, listener: RemoteRankListener) -> None:
        """Wait (bounded) for every other node's ranks to connect; they take ranks after node 0's."""

        def check_local() -> None:
            for rank, process in enumerate(self._processes):
                if not process.is_alive():
                    raise ExecutorDeadError(f"tensor-parallel worker rank {rank} (node 0, pid {process.pid}) "
                                            f"exited with code {process.exitcode} while waiting for the other nodes")

        remote = listener.accept_all(join_timeout_s(), check_local)
        for rank in sorted(remote):
            self._processes.append(None)
            self._conns.append(remote[rank])

    def _where(self, rank: int) -> str:
        """'rank R on node N' for messages that must say which machine to look at."""
        return f"rank {rank} on node {self.layout.node_of(rank)}"

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of this node's ranks' workers, by rank (the other nodes' ranks are not listed)."""
        return [process.pid for process in self._processes if process is not None]

    # ---- the Executor interface ---------------------------------------------------

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        specs_by_rank = self._call_all(GetKVCacheSpecs())
        if any(specs != specs_by_rank[DRIVER_RANK] for specs in specs_by_rank):
            raise RuntimeError("tensor-parallel ranks disagree on the KV-cache layout")
        return specs_by_rank[DRIVER_RANK]

    def determine_available_memory(self) -> int:
        # Every rank gets the same number of blocks, so the smallest budget decides.
        return min(self._call_all(AvailableKVMemory()))

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._call_all(InitializeKVCache(kv_cache_config))

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "Future[ModelRunnerOutput]":
        return self._submit(ExecuteModel(scheduler_output))

    def check_health(self) -> None:
        with self._lock:
            self._check_processes()
        if self._dead_reason is not None:
            raise ExecutorDeadError(self._dead_reason)
        self._raise_if_shut_down()

    def _stop_runners(self) -> None:
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            self._pending_changed.notify_all()  # the receiver sees the flag and returns
        for conn in self._conns:
            try:
                conn.send(Shutdown())
            except (BrokenPipeError, OSError):
                pass
        self._stop_workers()
        if self._receiver.is_alive():
            self._receiver.join(timeout=5.0)
        self._fail_pending(ExecutorDeadError("the executor has been shut down"))
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)

    # ---- calls and replies ----------------------------------------------------------

    def _call_all(self, worker_call: WorkerCall, send: bool = True) -> list[Any]:
        """Run `worker_call` on every rank and return their values, by rank."""
        return self._submit(worker_call, send=send).result()

    def _submit(self, worker_call: WorkerCall, send: bool = True) -> Future:
        with self._lock:
            self.check_health()
            return self._enqueue(worker_call, send)

    def _enqueue(self, worker_call: WorkerCall, send: bool) -> Future:
        """(Lock held.) Queue `worker_call` for the receiver and send it to every rank."""
        call = _PendingCall(worker_call)
        self._pending.append(call)
        self._pending_changed.notify_all()
        # Sent under the lock so that every rank sees the calls in one order.
        if send:
            # Pickled once for all ranks (Connection.recv unpickles what send_bytes sent).
            message = ForkingPickler.dumps(worker_call)
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(message)
                except (BrokenPipeError, OSError) as exc:
                    self._mark_dead(f"tensor-parallel {self._where(rank)} is unreachable: {exc}")
                    break
        return call.future

    def _receive_loop(self) -> None:
        """Pair replies with pending calls, oldest first; watch for dead workers meanwhile."""
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes) if process is not None}
        conns = {conn: rank for rank, conn in enumerate(self._conns)}
        while True:
            with self._lock:
                while not self._pending and not self._is_shut_down and self._dead_reason is None:
                    self._pending_changed.wait(timeout=self._idle_poll_s)
                    self._check_processes()
                    self._check_idle_remote_ranks()
                    self._send_heartbeat_if_due()
                if self._is_shut_down or self._dead_reason is not None:
                    return
                call = self._pending[0]
            waiting = [conn for conn, rank in conns.items() if rank not in call.replies]
            for ready in wait_for_ready(waiting + list(sentinels), timeout=self._idle_poll_s):
                if ready in conns:
                    self._take_reply(ready, conns[ready], call)
            if len(call.replies) == self.world_size:
                with self._lock:
                    self._pending.popleft()
                    self._last_answer_at = time.monotonic()
                self._resolve(call)
            else:
                with self._lock:
                    self._check_processes()
                    self._check_heartbeat_answered(call)

    def _take_reply(self, conn, rank: int, call: _PendingCall) -> None:
        try:
            call.replies[rank] = conn.recv()
        except (EOFError, OSError):
            if self._processes[rank] is None:
                with self._lock:
                    self._mark_dead(f"lost the connection to tensor-parallel {self._where(rank)}: "
                                    "the rank or its node died")
                return
            # The pipe closes a moment before the process can be reaped: wait for its exit code.
            self._processes[rank].join(timeout=2.0)
            with self._lock:
                self._check_processes()
                if self._dead_reason is None:
                    self._mark_dead(f"lost the connection to tensor-parallel {self._where(rank)}")

    def _resolve(self, call: _PendingCall) -> None:
        errors = {rank: reply.error for rank, reply in call.replies.items() if reply.error is not None}
        if not errors:
            values = [call.replies[rank].value for rank in range(self.world_size)]
            call.future.set_result(values[DRIVER_RANK] if isinstance(call.call, ExecuteModel) else values)
            return
        first_rank = min(errors)
        message = f"{call.call.name} failed on tensor-parallel rank {first_rank}: {errors[first_rank]}"
        logger.error("%s\n%s", message, call.replies[first_rank].error_traceback)
        if isinstance(call.call, (Startup, ExecuteModel)) and len(errors) < self.world_size:
            # Some ranks went on without the others: their collectives no longer line up.
            with self._lock:
                self._mark_dead(message)
            call.future.set_exception(ExecutorDeadError(message))
            return
        call.future.set_exception(WorkerStepError(message))

    # ---- failure and shutdown ----------------------------------------------------

    def _check_processes(self) -> None:
        """(Lock held.) Mark the executor dead if a worker process has exited."""
        if self._dead_reason is not None or self._is_shut_down:
            return
        for rank, process in enumerate(self._processes):
            if process is not None and not process.is_alive():
                reason = (f"tensor-parallel {self._where(rank)} (pid {process.pid}) exited "
                          f"unexpectedly with exit code {process.exitcode}")
                replies = self._pending[0].replies.values() if self._pending else ()
                errors = [reply for reply in replies if reply.error is not None]
                if errors:
                    reason += f"; rank {errors[0].rank} reported {errors[0].error}"
                self._mark_dead(reason)
                return

    def _check_idle_remote_ranks(self) -> None:
        """(Lock held, no call pending.) A remote rank's connection that is readable now can only
        be closing: its rank or node died."""
        if self._dead_reason is not None or self._is_shut_down or self._pending:
            return
        for rank, (process, conn) in enumerate(zip(self._processes, self._conns)):
            if process is not None:
                continue
            try:
                closing = conn.poll()
            except (EOFError, OSError):
                closing = True
            if closing:
                self._mark_dead(f"lost the connection to tensor-parallel {self._where(rank)}: "
                                "the rank or its node died")
                return

    def _send_heartbeat_if_due(self) -> None:
        """(Lock held, no call pending.) Ask every rank whether it is there, T/4 after the last answer."""
        if (not self._heartbeats or self._pending or self._dead_reason is not None or self._is_shut_down
                or time.monotonic() - self._last_answer_at < self._heartbeat_timeout_s / 4):
            return
        self._enqueue(Heartbeat(), send=True)

    def _check_heartbeat_answered(self, call: _PendingCall) -> None:
        """(Lock held.) Mark the executor dead when a rank has not answered `call`, a heartbeat,
        within T/2 of its sending: its node is down, stopped, or cut off."""
        if not isinstance(call.call, Heartbeat) or self._dead_reason is not None:
            return
        deadline_s = self._heartbeat_timeout_s / 2
        if time.monotonic() - call.sent_at < deadline_s:
            return
        silent = min(rank for rank in range(self.world_size) if rank not in call.replies)
        self._mark_dead(f"lost tensor-parallel {self._where(silent)}: no answer to a heartbeat within "
                        f"{deadline_s:g} s (the node is down, stopped or unreachable; --heartbeat-timeout "
                        f"{self._heartbeat_timeout_s:g})")

    def _mark_dead(self, reason: str) -> None:
        """(Lock held.) Record why, fail every pending call, and stop the surviving workers
        (they may be waiting in a collective for the dead one)."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        logger.error("%s", reason)
        error = ExecutorDeadError(reason)
        while self._pending:
            call = self._pending.popleft()
            if not call.future.done():
                call.future.set_exception(error)
        self._pending_changed.notify_all()
        for process, conn in zip(self._processes, self._conns):
            if process is None:
                # Another node's rank: ask it to exit (it may be waiting for the next call).
                try:
                    conn.send(Shutdown())
                except (BrokenPipeError, OSError):
                    pass
            elif process.is_alive():
                process.terminate()

    def _fail_pending(self, error: Exception) -> None:
        with self._lock:
            while self._pending:
                call = self._pending.popleft()
                if not call.future.done():
                    call.future.set_exception(error)

    def _stop_workers(self) -> None:
        for process in self._processes:
            if process is None:
                continue
            process.join(timeout=WORKER_EXIT_GRACE_S)
            if process.is_alive():
                logger.warning("tensor-parallel worker %s did not exit; terminating it", process.name)
                process.terminate()
                process.join(timeout=2.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=2.0)
