"""Engine configuration: plain, validated config classes, one per concern, gathered in
`EngineConfig`. `kvserve.engine.create_config.create_engine_config(...)` turns the
user-facing knobs (a model path or None, "2GiB", max_num_seqs, ...) into them.
Importing this module needs no torch.
"""
from __future__ import annotations

import logging
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


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policy of the continuous-batching scheduler.

    The defaults are the engine's: `create_engine_config` takes its own from here.
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

_UNIT_BYTES = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_MEMORY_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


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
