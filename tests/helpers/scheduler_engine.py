"""A real EngineCore (real Scheduler, KVCacheManager, block pool) over kvserve.testing's
FakeExecutor instead of a model: server tests of the KV cache without weights.

The pool is sized in blocks (tiny pools force preemptions); each step sleeps
`step_delay_s`, like a model step would.
"""
from __future__ import annotations

from functools import partial

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.kv_cache.events import KVEventsConfig
from kvserve.kv_cache.interface import FullAttentionSpec, KVCacheSpec
from kvserve.testing import FakeExecutor, fake_engine_config

_SPEC = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")


def scheduler_engine_config(max_model_len: int = 512, max_num_seqs: int = 16, block_size: int = 16,
                            async_scheduling: bool = True, hash_block_size: int | None = None,
                            kv_events_config=None) -> EngineConfig:
    return fake_engine_config(
        max_model_len,
        cache_config=CacheConfig(block_size=block_size, hash_block_size=hash_block_size),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                         max_model_len=max_model_len, async_scheduling=async_scheduling),
        kv_events_config=None if kv_events_config is None else KVEventsConfig(**kv_events_config))


def make_scheduler_engine_core(num_blocks: int = 64, step_delay_s: float = 0.002,
                               specs: dict[str, KVCacheSpec] | None = None, **config_kwargs):
    """An EngineCore with a pool of `num_blocks` blocks (the null block included)."""
    from kvserve.engine.core import EngineCore
    config = scheduler_engine_config(**config_kwargs)
    executor_class = partial(FakeExecutor, num_blocks=num_blocks, step_delay_s=step_delay_s,
                             kv_cache_specs=specs or {"layer.0": _SPEC})
    return EngineCore(config, executor_class=executor_class)


def make_scheduler_async_llm(tokenizer, num_blocks: int = 64, step_delay_s: float = 0.002, **kwargs):
    """An AsyncLLM over `make_scheduler_engine_core` and the real tokenizer."""
    from kvserve.engine.async_llm import AsyncLLM
    core_kwargs = {k: kwargs.pop(k) for k in ("max_model_len", "max_num_seqs", "specs", "async_scheduling")
                   if k in kwargs}
    core = make_scheduler_engine_core(num_blocks, step_delay_s, **core_kwargs)
    return AsyncLLM(core.engine_config, engine_core=core, tokenizer=tokenizer, **kwargs)
