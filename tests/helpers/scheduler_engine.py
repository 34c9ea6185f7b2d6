"""A real EngineCore (real Scheduler, KVCacheManager, block pool) over kvserve.testing's
FakeModelRunner instead of a model: server tests of the KV cache without weights.

The pool is sized in blocks (tiny pools force preemptions); each step sleeps
`step_delay_s` on an executor thread, like a model step would.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

from kvserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from kvserve.kv_cache.events import KVEventsConfig
from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheSpec
from kvserve.testing import FakeModelRunner
from kvserve.worker.executor import Executor

_SPEC = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")


def _fake_runner_executor(num_blocks: int, specs: dict[str, KVCacheSpec], step_delay_s: float):
    class FakeRunnerExecutor(Executor):
        """Executes steps with FakeModelRunner on one worker thread."""

        def __init__(self, engine_config) -> None:
            super().__init__(engine_config)
            self.runner = FakeModelRunner()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fake-runner")

        def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
            return dict(specs)

        def determine_available_memory(self) -> int:
            return num_blocks * sum(spec.page_size_bytes for spec in specs.values())

        def initialize_kv_cache(self, kv_cache_config) -> None:
            self.kv_cache_config = kv_cache_config

        def execute_model_async(self, scheduler_output) -> Future:
            def run():
                time.sleep(step_delay_s)
                return self.runner.execute(scheduler_output)
            return self._pool.submit(run)

        def check_health(self) -> None:
            pass

        def shutdown(self) -> None:
            self._pool.shutdown(wait=True)

    return FakeRunnerExecutor


def scheduler_engine_config(max_model_len: int = 512, max_num_seqs: int = 16, block_size: int = 16,
                            async_scheduling: bool = True, hash_block_size: int | None = None,
                            kv_events_config=None) -> EngineConfig:
    model_config = SimpleNamespace(max_model_len=max_model_len, vocab_size=49152, eos_token_ids=[],
                                   path="/models/fake-model")
    return EngineConfig(model_config=model_config,
                        cache_config=CacheConfig(block_size=block_size, hash_block_size=hash_block_size),
                        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                                         max_model_len=max_model_len,
                                                         async_scheduling=async_scheduling),
                        parallel_config=ParallelConfig(),
                        kv_events_config=None if kv_events_config is None else KVEventsConfig(**kv_events_config))


def make_scheduler_engine_core(num_blocks: int = 64, step_delay_s: float = 0.002,
                               specs: dict[str, KVCacheSpec] | None = None, **config_kwargs):
    """An EngineCore with a pool of `num_blocks` blocks (the null block included)."""
    from kvserve.engine.core import EngineCore
    specs = specs or {"layer.0": _SPEC}
    config = scheduler_engine_config(**config_kwargs)
    return EngineCore(config, executor_class=_fake_runner_executor(num_blocks, specs, step_delay_s))


def make_scheduler_async_llm(tokenizer, num_blocks: int = 64, step_delay_s: float = 0.002, **kwargs):
    """An AsyncLLM over `make_scheduler_engine_core` and the real tokenizer."""
    from kvserve.engine.async_llm import AsyncLLM
    core_kwargs = {k: kwargs.pop(k) for k in ("max_model_len", "max_num_seqs", "specs", "async_scheduling")
                   if k in kwargs}
    core = make_scheduler_engine_core(num_blocks, step_delay_s, **core_kwargs)
    return AsyncLLM(core.engine_config, engine_core=core, tokenizer=tokenizer, **kwargs)
