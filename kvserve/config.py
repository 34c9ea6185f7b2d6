"""Engine configuration: one small, validated object per concern."""
from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it."""


@dataclass(frozen=True)
class CacheConfig:
    """KV-cache layout: block size, memory budget, prefix caching.

    `hash_block_size` (default: block_size) may be a divisor of block_size: a
    full-attention prompt can then hit inside a block (partial hit, served by
    a copy-on-write block copy). `sliding_window_kv` chooses how windowed
    layers hold KV: "sliding" (released blocks) or "circular" (a fixed ring).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    hash_block_size: int | None = None
    prefix_caching_hash_algo: str = "sha256"
    sliding_window_kv: str = "sliding"

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

    @property
    def effective_hash_block_size(self) -> int:
        return self.hash_block_size or self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policy of the continuous-batching scheduler."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    async_scheduling: bool = False
    # Defer frees of blocks an in-flight step may still touch (default: on with async).
    defer_block_free: bool | None = None

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

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
