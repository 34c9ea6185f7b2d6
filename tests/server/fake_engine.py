"""A model-free EngineCore for server tests: deterministic words, real bookkeeping.

`FakeEngineCore` has the EngineCore surface AsyncLLM uses (add_request,
abort_requests, step, has_unfinished_requests, get_stats, shutdown). Each
step gives every running request one token from a fixed list of word tokens:
greedy requests pick a function of the prompt and position, sampled ones draw
from `random.Random(seed)`. It counts KV blocks like a paged cache would, so
tests can check that aborted and finished requests give their blocks back.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvserve.engine.validation import RequestValidator
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.output import EngineCoreOutput, TokenLogprobs
from kvserve.scheduler.stats import SchedulerStats

WORDS = (" the quick brown fox jumps over a lazy dog while seven small birds sing"
         " about green hills and blue rivers under bright morning light")


@dataclass
class _FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    rng: random.Random
    output_token_ids: list[int] = field(default_factory=list)


def fake_engine_config(max_model_len: int = 256, max_num_seqs: int = 8, vocab_size: int = 49152):
    model_config = SimpleNamespace(max_model_len=max_model_len, vocab_size=vocab_size,
                                   eos_token_ids=[2], path="/models/fake-model")
    scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    return SimpleNamespace(model_config=model_config, scheduler_config=scheduler_config,
                           max_model_len=max_model_len)


class FakeEngineCore:
    """Deterministic token generator with a paged-KV block count."""

    def __init__(self, tokenizer, engine_config, *, num_blocks: int = 512, block_size: int = 16,
                 step_delay_s: float = 0.002) -> None:
        self.word_ids = tokenizer.encode(WORDS, add_special_tokens=False)
        self.engine_config = engine_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.step_delay_s = step_delay_s
        self.fail_next_step: Exception | None = None
        self.fail_next_token: str | None = None  # finish the next request with "error"
        self.requests: dict[str, _FakeRequest] = {}
        self.aborted_ids: list[str] = []
        self.shut_down = False
        self.step_thread_ids: set[int] = set()
        self.validator = RequestValidator(engine_config.max_model_len, engine_config.model_config.vocab_size)

    def add_request(self, request) -> None:
        prompt = list(request.prompt_token_ids)
        if not prompt or len(prompt) >= self.engine_config.max_model_len:
            raise ValueError(f"request {request.request_id!r}: bad prompt length {len(prompt)}")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        params = request.sampling_params
        rng = random.Random(params.seed if params.seed is not None else time.perf_counter_ns())
        self.requests[request.request_id] = _FakeRequest(request.request_id, prompt, params, rng)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted_ids.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        self.step_thread_ids.add(threading.get_ident())
        if self.fail_next_step is not None:
            error, self.fail_next_step = self.fail_next_step, None
            raise error
        time.sleep(self.step_delay_s)
        running = list(self.requests.values())[:self.engine_config.scheduler_config.max_num_seqs]
        return [self._advance(request) for request in running]

    def _advance(self, request: _FakeRequest) -> EngineCoreOutput:
        if self.fail_next_token is not None:
            message, self.fail_next_token = self.fail_next_token, None
            del self.requests[request.request_id]
            return EngineCoreOutput(request.request_id, [], "error", message)
        params = request.params
        position = len(request.output_token_ids)
        if params.temperature == 0:
            choice = (sum(request.prompt_token_ids) + position) % len(self.word_ids)
        else:
            choice = request.rng.randrange(len(self.word_ids))
        token_id = self.word_ids[choice]
        request.output_token_ids.append(token_id)
        finish_reason = stop_reason = None
        if token_id in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token_id
        elif len(request.output_token_ids) >= params.max_tokens:
            finish_reason = "length"
        if finish_reason is not None:
            del self.requests[request.request_id]
        logprobs = None
        if params.logprobs is not None:
            top_ids = [self.word_ids[(choice + k) % len(self.word_ids)] for k in range(params.logprobs)]
            top_lps = [-0.5 - k for k in range(params.logprobs)]
            logprobs = [TokenLogprobs(token_id, -0.5, 1, top_ids, top_lps)]
        return EngineCoreOutput(request.request_id, [token_id], finish_reason, stop_reason,
                                new_logprobs=logprobs, num_cached_tokens=0)

    def used_blocks(self) -> int:
        return sum(math.ceil((len(r.prompt_token_ids) + len(r.output_token_ids)) / self.block_size)
                   for r in self.requests.values())

    def get_stats(self) -> SchedulerStats:
        num_running = min(len(self.requests), self.engine_config.scheduler_config.max_num_seqs)
        return SchedulerStats(num_running, len(self.requests) - num_running,
                              self.used_blocks() / self.num_blocks, prefix_cache_queries=0,
                              prefix_cache_hits=0, num_preemptions=0, num_deferred_blocks=0,
                              sched_step_seq=0, processed_step_seq=0)

    def shutdown(self) -> None:
        self.shut_down = True


def make_fake_async_llm(tokenizer, **kwargs):
    """An AsyncLLM over FakeEngineCore and the real tokenizer / OutputProcessor."""
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.output_processor import OutputProcessor

    engine_kwargs = {k: kwargs.pop(k) for k in ("max_model_len", "max_num_seqs") if k in kwargs}
    config = fake_engine_config(**engine_kwargs)
    core = FakeEngineCore(tokenizer, config, step_delay_s=kwargs.pop("step_delay_s", 0.002))
    return AsyncLLM(config, engine_core=core, tokenizer=tokenizer,
                    output_processor=OutputProcessor(tokenizer), **kwargs)
