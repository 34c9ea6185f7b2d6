"""The CPU KV pool's default size: what every sequence at full length wants, bounded by a cap and a
quarter of the memory the machine has free, and said at start-up."""
from __future__ import annotations

from kvserve.worker.model_runner import CPU_DEFAULT_KV_CAP_BYTES, _free_ram_bytes, default_cpu_kv_bytes

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
