"""`create_engine_config(...)`: the one place that turns user-facing knobs (a model path
or None, "2GiB", max_num_seqs, ...) into the validated `ModelConfig`, `CacheConfig`,
`SchedulerConfig` and `ParallelConfig` gathered in an `EngineConfig` (`kvserve.config`,
plain config classes)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from kvserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, default_device, parse_memory_size
from kvserve.engine.model_path import ModelNotFoundError, resolve_model_path
from kvserve.errors import ConfigError
from kvserve.native.config import KernelConfig

if TYPE_CHECKING:
    from kvserve.kv_cache.events import KVEventsConfig
    from kvserve.spec_decode.config import SpeculativeConfig


def create_engine_config(
    model: str | None = None,
    dtype: str | None = None,
    quantization: str = "auto",
    kv_cache_memory: int | str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = SchedulerConfig.max_num_seqs,
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
    enable_prefix_caching: bool = True,
    block_size: int = CacheConfig.block_size,
    hash_block_size: int | None = None,
    tensor_parallel_size: int = 1,
    async_scheduling: bool = SchedulerConfig.async_scheduling,
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill,
    policy: str = SchedulerConfig.policy,
    sliding_window_kv: str = CacheConfig.sliding_window_kv,
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype,
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
    device: str | None = None,
    seed: int = 0,
    speculative_config: "SpeculativeConfig | dict | str | None" = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = ParallelConfig.master_addr,
    master_port: int = ParallelConfig.master_port,
    heartbeat_timeout_s: float = ParallelConfig.heartbeat_timeout_s,
    kv_events_config: "KVEventsConfig | dict | str | None" = None,
) -> EngineConfig:
    """Build and validate the whole configuration from user-facing knobs (the defaults of
    `LLM(...)`, the CLI and the server live here)."""
    from kvserve.model.config import QUANTIZATION_MODES, ModelConfig

    spec_config = _speculative_config(speculative_config)  # checked before the model loads
    if quantization not in QUANTIZATION_MODES:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {quantization!r}")
    kernel_config = KernelConfig.from_env()
    path = resolve_model_path(model)
    device = device or default_device()
    if dtype is None:  # the fastest path that passes the accuracy checks here
        from kvserve.model.quantized import default_dtype
        dtype = default_dtype(path, quantization, device, kernel_config)
    model_config = ModelConfig.from_path(path, dtype=dtype, max_model_len=max_model_len,
                                         quantization=quantization)
    context_len = model_config.max_model_len
    cache_config = CacheConfig(
        block_size=block_size,
        kv_cache_memory_bytes=None if kv_cache_memory is None else parse_memory_size(kv_cache_memory),
        gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=enable_prefix_caching,
        hash_block_size=hash_block_size,
        sliding_window_kv=sliding_window_kv,
        kv_cache_dtype=kv_cache_dtype,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=(max_num_batched_tokens if enable_chunked_prefill
                                else max(max_num_batched_tokens, context_len)),
        max_model_len=context_len,
        enable_chunked_prefill=enable_chunked_prefill,
        policy=policy,
        async_scheduling=async_scheduling,
        speculative_config=spec_config,
    )
    parallel_config = ParallelConfig(tensor_parallel_size=tensor_parallel_size, nnodes=nnodes,
                                     node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                                     heartbeat_timeout_s=heartbeat_timeout_s)
    return EngineConfig(model_config, cache_config, scheduler_config, parallel_config, device=device, seed=seed,
                        kv_events_config=_kv_events_config(kv_events_config), kernel_config=kernel_config,
                        draft_model_config=_draft_model_config(spec_config, model_config, tensor_parallel_size))


def _kv_events_config(value) -> "KVEventsConfig | None":
    """vLLM's `kv_events_config` (dict, JSON text or object); ConfigError when invalid."""
    from kvserve.kv_cache.events import KVEventsConfig
    if value is None or isinstance(value, KVEventsConfig):
        return value
    return KVEventsConfig.from_json(value if isinstance(value, str) else json.dumps(value))


def _draft_model_config(spec_config, model_config, tensor_parallel_size: int):
    """The draft's ModelConfig for method "draft_model" (None otherwise); ConfigError
    when the draft cannot serve this target."""
    if spec_config is None or not spec_config.uses_draft_model:
        return None
    from kvserve.spec_decode.config import SpeculativeConfigError
    from kvserve.model.draft_config import load_draft_model_config
    try:
        return load_draft_model_config(spec_config, model_config, resolve_model_path(spec_config.model),
                                       tensor_parallel_size)
    except SpeculativeConfigError as exc:
        raise ConfigError(str(exc)) from None
    except ModelNotFoundError as exc:
        raise ConfigError(f"speculative_config: draft {exc}") from None


def _speculative_config(value) -> "SpeculativeConfig | None":
    """vLLM's `speculative_config` (dict, JSON text or object), as a ConfigError when invalid."""
    from kvserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
    try:
        return SpeculativeConfig.from_value(value)
    except SpeculativeConfigError as exc:
        raise ConfigError(str(exc)) from None
