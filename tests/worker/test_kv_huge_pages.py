"""The KV pool's memory: blocks of an anonymous mapping stay untouched until used, off transparent huge pages
(a huge page is faulted in whole, 2 MiB of every (layer, K/V, head) region on the first token),
and huge pages are advised as the used part grows, at most twice the used bytes."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvserve.kv_cache.interface import FullAttentionSpec
from kvserve.kv_cache.utils import get_kv_cache_config
from kvserve.native import cpu_kernels
from kvserve.worker import kv_tensors
from kvserve.worker.kv_tensors import KVHugePageGrowth, allocate_kv_caches

HUGE = cpu_kernels.HUGE_PAGE_BYTES
needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_linux
def test_a_pool_buffer_is_kept_off_huge_pages_until_advised():
    buffer = cpu_kernels.zeros_on_huge_pages(8 * HUGE, advise=False)
    assert buffer.data_ptr() % HUGE == 0 and int(buffer.count_nonzero()) == 0
    assert "nh" in _vm_flags(buffer.data_ptr())  # numpy's own huge-page advice taken back
    assert cpu_kernels.advise_huge_pages(buffer.data_ptr() + 2 * HUGE, 2 * HUGE)
    assert "hg" in _vm_flags(buffer.data_ptr() + 2 * HUGE)
    assert "nh" in _vm_flags(buffer.data_ptr())
    advised = cpu_kernels.zeros_on_huge_pages(8 * HUGE)
    assert "hg" in _vm_flags(advised.data_ptr())


def _pool(num_blocks: int):
    # 2 layers x (K, V) x 2 heads = 8 regions of num_blocks blocks of 16 x 64 x 2 bytes (2 KiB).
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    specs = {"l0": spec, "l1": spec}
    return allocate_kv_caches(get_kv_cache_config(specs, 0, num_blocks=num_blocks), specs)


def test_huge_pages_follow_the_used_blocks(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernels, "advise_huge_pages", lambda address, nbytes: calls.append((address, nbytes)))
    caches = _pool(num_blocks=8192)  # 16 MiB per region
    growth = KVHugePageGrowth(caches)
    block_bytes = 16 * 64 * 2
    region_bytes = 8192 * block_bytes
    starts = sorted(cache.data_ptr() + i * region_bytes for cache in caches.values() for i in range(4))
    assert sorted(growth.regions) == starts and len(set(starts)) == 8

    blocks_per_huge_page = HUGE // block_bytes
    growth.note_blocks(blocks_per_huge_page - 2)  # used part under one huge page: no advice
    assert calls == []
    growth.note_blocks(blocks_per_huge_page - 1)  # one huge page used: advise twice that
    assert sorted(calls) == [(start, 2 * HUGE) for start in starts]
    calls.clear()
    growth.note_blocks(10)  # a lower block id changes nothing
    growth.note_blocks(blocks_per_huge_page)  # a little more used: twice it rounds up to 3 huge pages
    assert sorted(calls) == [(start + 2 * HUGE, HUGE) for start in starts]
    calls.clear()
    growth.note_blocks(3 * blocks_per_huge_page // 2 - 1)  # 1.5 huge pages used: 3 advised already
    assert calls == []
    growth.note_blocks(8191)  # the whole pool: advice stops at each region's end
    assert sorted(calls) == [(start + 3 * HUGE, region_bytes - 3 * HUGE) for start in starts]
    assert all(advised == region_bytes for advised in growth.advised_bytes.values())


def test_highest_block_id_of_a_step():
    from kvserve.messages import CachedRequestData, NewRequestData, SchedulerOutput
    from kvserve.sampling_params import SamplingParams
    new = NewRequestData("a", [1, 2], SamplingParams(), ([3, 9],), 0)
    cached = CachedRequestData(["b", "c"], [([4, 17],), None], [5, 6])
    output = SchedulerOutput(step_seq=1, scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                             num_scheduled_tokens={"a": 2, "b": 1, "c": 1}, total_num_scheduled_tokens=4)
    assert kv_tensors.highest_block_id(output) == 17
    assert kv_tensors.highest_block_id(SchedulerOutput(
        step_seq=2, scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(), num_scheduled_tokens={},
        total_num_scheduled_tokens=0)) == -1


def _resident_kib(tensor) -> int:
    """KiB of `tensor`'s pages resident in memory (mincore over its byte range): the pool's own
    pages, whatever else the process allocates meanwhile."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pages = (end - start + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector) * page // 1024


def _dirty_the_heap() -> None:
    """Leaves 80 MiB of freed, resident memory in the heap, as loading a model can: a large
    buffer taken from the heap (mmap threshold raised), written and freed, and the heap not
    trimmed (trim threshold raised: glibc raises both itself as a process frees large
    buffers). A calloc'ed pool would reuse that memory and clear it, touching every page."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mallopt(-3, 1 << 30) == 1 and libc.mallopt(-1, 1 << 30) == 1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    dirty = np.ones(80 << 20, dtype=np.uint8)
    del dirty


def _untouched_blocks_resident_kib(dirty_heap: bool = False) -> tuple[int, int]:
    """(pool KiB resident before any write, after writing block 1 of each region)."""
    if dirty_heap:
        _dirty_the_heap()
    caches = _pool(num_blocks=4096)  # 64 MiB in all
    before = sum(_resident_kib(cache) for cache in caches.values())
    growth = KVHugePageGrowth(caches)
    growth.note_blocks(1)
    for cache in caches.values():
        cache[:, :, 1] = 1.0
    return before, sum(_resident_kib(cache) for cache in caches.values())


@needs_linux
@pytest.mark.parametrize("dirty_heap", [False, True])
def test_untouched_blocks_take_no_memory(dirty_heap):
    """Writing block 1 of every region of a 64 MiB pool makes 8 small pages of the pool resident,
    not the pool and not 8 huge pages (mincore over each layer's cache), also after the heap
    holds freed resident memory (glibc only: mallopt). In a fresh process, so that the heap's
    state is the test's own."""
    if dirty_heap and not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("no glibc mallopt to fill the heap with")
    code = ("import sys; sys.path.insert(0, 'tests/worker'); import test_kv_huge_pages as t; "
            f"print(*t._untouched_blocks_resident_kib({dirty_heap}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    before, after = (int(part) for part in done.stdout.split())
    # 8 regions x block 1 (2 KiB at offset 2 KiB: inside the region's first 4 KiB page) = 32 KiB;
    # a huge page faulted in would show as its 512 small pages (16 MiB for 8).
    assert before == 0 and after == 8 * os.sysconf("SC_PAGE_SIZE") // 1024, (before, after)
