"""The CPU KV pool's default size: what every sequence at full length wants, bounded by a cap and a
quarter of the memory the machine has free, and said at start-up."""
from __future__ import annotations

from kvserve.kv_cache.interface import FullAttentionSpec
from kvserve.kv_cache.layout import StatePoolSizing
from kvserve.worker.model_runner import (CPU_DEFAULT_KV_CAP_BYTES, _free_ram_bytes, default_cpu_kv_bytes,
                                         kv_bytes_with_null_block)

GIB = 1 << 30


def test_each_bound_wins_where_it_is_smallest():
    assert default_cpu_kv_bytes(256 << 20, 16 * GIB) == (256 << 20, "every sequence at full length")
    assert default_cpu_kv_bytes(64 * GIB, 64 * GIB) == (CPU_DEFAULT_KV_CAP_BYTES, "the default cap")
    assert default_cpu_kv_bytes(64 * GIB, 2 * GIB) == (GIB // 2, "a quarter of the free memory")


def test_free_memory_is_what_the_kernel_calls_available():
    with open("/proc/meminfo") as meminfo:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
    # MemAvailable moves while other processes run: compare within 10% of the machine's memory.
    assert abs(_free_ram_bytes() - fields["MemAvailable"]) < fields["MemTotal"] // 10
    assert _free_ram_bytes() >= fields["MemFree"] - fields["MemTotal"] // 10


def test_the_request_wants_whole_blocks_for_every_sequence_plus_the_null_block():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype="float16")
    page = 16 * 8 * 64 * 2 * 2  # 16 tokens x 8 heads x 64 x (K, V) x 2 bytes
    assert spec.page_size_bytes == page
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(16)}  # a Llama-3.2-1B: 16 layers

    def wanted(num_seqs: int, max_model_len: int) -> int:
        sizing = StatePoolSizing(max_num_seqs=num_seqs, max_num_batched_tokens=2048, enable_caching=True)
        return kv_bytes_with_null_block(specs, max_model_len, sizing)
    # One sequence of 8192 tokens: 512 blocks + the null block, 32 KiB a token.
    assert wanted(1, 8192) == 16 * 513 * page == 256 * 2**20 + 16 * page
    # A partial block is a whole block: 3 sequences of 17 tokens take 2 blocks each.
    assert wanted(3, 17) == 16 * 7 * page
