"""A request as the scheduler and the KV cache see it: token ids and counters.

Pure Python. There are no prefill or decode phases: `num_computed_tokens`
catches up with `num_tokens` (prompt + outputs) step by step.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Callable

from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finish."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)


# OpenAI finish_reason strings.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated: prompt, outputs, progress and KV bookkeeping.

    `block_hashes` holds the chained hash of every complete `hash_block_size`
    unit of the token sequence; `block_hasher` (from `kv_cache.utils`) extends
    it whenever tokens are appended, so `len(block_hashes) == num_tokens // H`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: Callable[["Request"], list[Any]] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params or SamplingParams()
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Async scheduling: tokens scheduled but whose step is not processed yet,
        # and output slots scheduled before their token is known.
        self.num_in_flight_tokens = 0
        self.num_output_placeholders = 0
        # Sequence number of the newest step that scheduled this request.
        self.last_sched_seq = 0
        # Speculative decoding: the draft tokens of the step in flight, if any.
        self.spec_token_ids: list[int] = []
        # SamplingParams.prompt_logprobs: prompt tokens 1 .. n-1 scored so far (filled by
        # position, chunk by chunk), until they go out with the first sampled token.
        self.prompt_logprobs: list[Any] | None = None
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * max(self.num_prompt_tokens - 1, 0)
        self.block_hashes: list[Any] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def reads_prefix_cache(self) -> bool:
        """False while the request still needs its prompt logprobs: those need every prompt
        position's logits, so its prompt is computed whole (as vLLM does)."""
        return self.prompt_logprobs is None

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
