"""A model-free engine for server tests: the real EngineCore over a fake executor.

`make_fake_async_llm` builds an `AsyncLLM` whose `EngineCore` (real scheduler,
real KV-cache manager, real loop) runs a `FakeExecutor` from `kvserve.testing`
around `WordRunner`. Each step gives every scheduled request one token from a
fixed list of word tokens: greedy requests pick a function of the prompt and
position, sampled ones draw from `random.Random(seed)`.
"""
from __future__ import annotations

import random
import time
from functools import partial

from kvserve.config import EngineConfig, SchedulerConfig
from kvserve.engine.core import EngineCore
from kvserve.messages import TokenLogprobs
from kvserve.testing import FakeExecutor, FakeModelRunner, fake_engine_config

WORDS = (" the quick brown fox jumps over a lazy dog while seven small birds sing"
         " about green hills and blue rivers under bright morning light")


class WordRunner(FakeModelRunner):
    """Samples word tokens: greedy from the prompt and position, sampled from a seeded RNG."""

    def __init__(self, word_ids: list[int], vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self.word_ids = word_ids
        self._rngs: dict[str, random.Random] = {}

    def _choice(self, request_id: str, position: int) -> int:
        state = self.states[request_id]
        params = state.sampling_params
        if params.temperature == 0:
            return (sum(state.token_ids[:state.prompt_len]) + position - state.prompt_len) % len(self.word_ids)
        if request_id not in self._rngs:
            self._rngs[request_id] = random.Random(params.seed if params.seed is not None
                                                   else time.perf_counter_ns())
        return self._rngs[request_id].randrange(len(self.word_ids))

    def token_for(self, request_id: str, position: int, prompt_len: int) -> int:
        return self.word_ids[self._choice(request_id, position)]

    def logprobs_for(self, request_id: str, token_id: int) -> TokenLogprobs:
        num_top = self.states[request_id].sampling_params.logprobs or 0
        first = self.word_ids.index(token_id)
        top_ids = [self.word_ids[(first + k) % len(self.word_ids)] for k in range(num_top)]
        return TokenLogprobs(token_id, -0.5, 1, top_ids, [-0.5 - k for k in range(num_top)])


class ScriptedRunner(FakeModelRunner):
    """Writes the same reply to every request: `script`'s token ids, then `eos_id` on and on."""

    def __init__(self, script: list[int], eos_id: int, vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self.script = script
        self.eos_id = eos_id

    def token_for(self, request_id: str, position: int, prompt_len: int) -> int:
        index = position - prompt_len
        return self.script[index] if index < len(self.script) else self.eos_id


class RecordingEngineCore(EngineCore):
    """The real EngineCore, noting which live requests were aborted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aborted_ids: list[str] = []

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted_ids.extend(r for r in request_ids if r in self.scheduler.requests)
        super().abort_requests(request_ids)


def server_engine_config(max_model_len: int = 256, max_num_seqs: int = 8) -> EngineConfig:
    return fake_engine_config(max_model_len, eos_token_ids=[2], scheduler_config=SchedulerConfig(
        max_num_seqs=max_num_seqs, max_model_len=max_model_len))


def make_fake_async_llm(tokenizer, script: str | None = None, **kwargs):
    """An AsyncLLM over the real EngineCore with a fake executor, the real tokenizer and OutputProcessor;
    every reply is `script` (then EOS) where given, else words (`WordRunner`)."""
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.output_processor import OutputProcessor

    engine_kwargs = {k: kwargs.pop(k) for k in ("max_model_len", "max_num_seqs") if k in kwargs}
    config = server_engine_config(**engine_kwargs)
    vocab_size = config.model_config.vocab_size
    if script is not None:
        runner = ScriptedRunner(tokenizer.encode(script, add_special_tokens=False),
                                config.model_config.eos_token_ids[0], vocab_size)
    else:
        runner = WordRunner(tokenizer.encode(WORDS, add_special_tokens=False), vocab_size)
    executor_class = partial(FakeExecutor, runner=runner, step_delay_s=kwargs.pop("step_delay_s", 0.002))
    core = RecordingEngineCore(config, executor_class=executor_class)
    return AsyncLLM(config, engine_core=core, tokenizer=tokenizer,
                    output_processor=OutputProcessor(tokenizer), **kwargs)
