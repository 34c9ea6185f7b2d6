"""The worker process of a tensor-parallel group: one rank, one ModelRunner.

Every rank runs the same steps on its shard of the weights and of the KV
cache; the row-parallel layers all-reduce, so all ranks hold the same hidden
states. Rank 0 (the driver) gathers the logits, samples, and broadcasts the
sampled token ids so that every rank's persistent batch state (used for
async placeholders) stays identical. Only rank 0's step output goes back to
the engine.

Messages on the pipe from the executor are `WorkerCall`s; every call gets
exactly one `WorkerReply`, in order.
"""
from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Union

import torch

from kvserve.kv_cache.interface import KVCacheConfig
from kvserve.messages import SchedulerOutput
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.input_batch import PreparedBatch
from kvserve.worker.prompt_logprobs import gather_prompt_logprobs, plan_prompt_logprobs

logger = logging.getLogger(__name__)

DRIVER_RANK = 0


@dataclass(frozen=True, slots=True)
class Startup:
    """Not sent: the executor's pending call that the workers' "ready" replies answer."""

    name = "startup"


@dataclass(frozen=True, slots=True)
class GetKVCacheSpecs:
    """Each rank's per-layer KV-cache specs (they must agree)."""

    name = "get_kv_cache_specs"


@dataclass(frozen=True, slots=True)
class AvailableKVMemory:
    """Bytes each rank's KV cache may use."""

    name = "available_kv_memory_bytes"


@dataclass(frozen=True, slots=True)
class InitializeKVCache:
    """Allocate the KV tensors of this layout."""

    kv_cache_config: KVCacheConfig
    name = "initialize_kv_cache"


@dataclass(frozen=True, slots=True)
class ExecuteModel:
    """Run one step; only the driver rank's reply carries the output."""

    scheduler_output: SchedulerOutput
    name = "execute_model"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Node 0's "still there?" to every rank while no call is pending; answered at once."""

    name = "heartbeat"


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the serving loop (no reply)."""

    name = "shutdown"


# One request from the executor to every rank; `name` says which in messages.
WorkerCall = Union[Startup, GetKVCacheSpecs, AvailableKVMemory, InitializeKVCache, ExecuteModel, Heartbeat,
                   Shutdown]


@dataclass
class WorkerReply:
    """The answer to one `WorkerCall`: a value, or this rank's error (one line, and its traceback)."""

    rank: int
    value: Any = None
    error: str | None = None
    error_traceback: str | None = None

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException) -> "WorkerReply":
        return cls(rank, error=f"{type(exc).__name__}: {exc}", error_traceback=traceback.format_exc(limit=12))


@dataclass(frozen=True)
class WorkerInit:
    """What a worker process needs to join the group and build its runner."""

    rank: int
    world_size: int
    backend: str
    init_method: str
    device: str
    num_threads: int
    collective_timeout_s: float


def distributed_backend(device: str, configured: str | None = None) -> str:
    """The torch.distributed backend: the configured one, else nccl on CUDA and gloo on CPU."""
    if configured:
        return configured
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """Rank r uses CUDA device (base + r) of `cuda[:base]`; CPU ranks share the CPU."""
    if not device.startswith("cuda"):
        return "cpu"
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


# Fills the rows of requests that emitted fewer tokens than the longest in the step.
PAD_TOKEN = -2


class TPModelRunner(ModelRunner):
    """A ModelRunner for one rank: the driver samples and broadcasts the tokens."""

    def _forward_and_sample(self, prepared: PreparedBatch) -> tuple[dict[str, list[int]], dict, dict]:
        pending_masks = self._start_masks(prepared) if self.tp_rank == DRIVER_RANK else None
        # Every rank derives the same batch (and prompt-scoring plan) from the same
        # SchedulerOutput, so all take these branches together and the collectives line up.
        prompt_plan = plan_prompt_logprobs(prepared, self.input_batch.states)
        hidden_rows = self._forward_sampled_rows(prepared, None if prompt_plan is None else prompt_plan.rows)
        if hidden_rows is None:
            return {}, {}, {}
        logits = self.model.compute_logits_on_driver(hidden_rows, prepared.total_draft_tokens)
        prompt_logprobs = {}
        if prompt_plan is not None and logits is not None:
            num_sampled = len(prepared.logits_indices)
            prompt_logprobs = gather_prompt_logprobs(logits[num_sampled:], prompt_plan)
            logits = logits[:num_sampled]
        sampled_req_ids = prepared.sampled_req_ids
        if not sampled_req_ids:
            return {}, {}, prompt_logprobs
        # One row per request: its 1 to 1 + drafts tokens, padded with PAD_TOKEN. -1
        # tells the other ranks that the driver's sampling failed, so that they fail
        # the step too instead of waiting in the broadcast.
        max_tokens = 1 + max((len(prepared.draft_token_ids.get(rid, ())) for rid in sampled_req_ids), default=0)
        token_ids = torch.full((len(sampled_req_ids), max_tokens), PAD_TOKEN, dtype=torch.int64,
                               device=self.device)
        logprobs_by_req, sampling_error = {}, None
        if logits is not None:
            try:
                sampled, logprobs_by_req = self._sample(logits, prepared, pending_masks)
                for row, req_id in enumerate(sampled_req_ids):
                    token_ids[row, :len(sampled[req_id])] = torch.as_tensor(sampled[req_id], dtype=torch.int64)
            except Exception as exc:
                sampling_error = exc
                token_ids.fill_(-1)
        torch.distributed.broadcast(token_ids, src=DRIVER_RANK)
        if sampling_error is not None:
            raise sampling_error
        if bool((token_ids == -1).any()):
            raise RuntimeError("sampling failed on the driver rank")
        sampled_token_ids = {req_id: [t for t in row if t != PAD_TOKEN]
                             for req_id, row in zip(sampled_req_ids, token_ids.tolist())}
        self._record_sampled(sampled_token_ids)
        return sampled_token_ids, logprobs_by_req, prompt_logprobs


class TPWorker:
    """One rank's state in its process; `handle` answers each `WorkerCall`."""

    def __init__(self, engine_config, init: WorkerInit) -> None:
        self.rank = init.rank
        self.runner = TPModelRunner(
            engine_config.model_config, engine_config.cache_config, init.device,
            scheduler_config=engine_config.scheduler_config, seed=engine_config.seed,
            tp_rank=init.rank, tp_size=init.world_size, kernel_config=engine_config.kernel_config)
        self.runner.load_model()

    def get_kv_cache_specs(self):
        return self.runner.get_kv_cache_specs()

    def available_kv_memory_bytes(self) -> int:
        return self.runner.available_kv_memory_bytes()

    def initialize_kv_cache(self, kv_cache_config) -> None:
        self.runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output):
        output = self.runner.execute_model(scheduler_output)
        # Only the driver's output is used; the others only say "done".
        return output if self.rank == DRIVER_RANK else None

    def handle(self, call: WorkerCall) -> Any:
        """The value of one call from the executor."""
        if isinstance(call, ExecuteModel):
            return self.execute_model(call.scheduler_output)
        if isinstance(call, GetKVCacheSpecs):
            return self.get_kv_cache_specs()
        if isinstance(call, AvailableKVMemory):
            return self.available_kv_memory_bytes()
        if isinstance(call, InitializeKVCache):
            return self.initialize_kv_cache(call.kv_cache_config)
        if isinstance(call, Heartbeat):
            return None
        raise TypeError(f"a worker cannot handle {type(call).__name__}")


def _init_process(init: WorkerInit) -> None:
    # Ctrl-C reaches the whole process group; the engine decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(init.num_threads)
    if init.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(init.device))
    torch.distributed.init_process_group(
        backend=init.backend, init_method=init.init_method, rank=init.rank, world_size=init.world_size,
        timeout=timedelta(seconds=init.collective_timeout_s))


def worker_main(engine_config, init: WorkerInit, conn) -> None:
    """Entry point of a worker process: join the group, load the shard, serve calls until "shutdown"."""
    logging.basicConfig(level=os.environ.get("KVSERVE_WORKER_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s tp-rank{init.rank} %(levelname)s %(name)s: %(message)s")
    try:
        _init_process(init)
        worker = TPWorker(engine_config, init)
    except BaseException as exc:
        conn.send(WorkerReply.from_exception(init.rank, exc))
        return
    conn.send(WorkerReply(init.rank, value="ready"))
    try:
        _serve(worker, conn)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _serve(worker: TPWorker, conn) -> None:
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return  # the engine went away
        if isinstance(call, Shutdown):
            return
        try:
            reply = WorkerReply(worker.rank, value=worker.handle(call))
        except Exception as exc:
            reply = WorkerReply.from_exception(worker.rank, exc)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
