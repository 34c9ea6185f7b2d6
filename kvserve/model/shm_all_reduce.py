"""The tensor-parallel ranks of one host sum through shared memory (native/csrc/comm/shm_all_reduce.c).

The native decoder all-reduces its O and down outputs from inside its call, twice per
layer. Over gloo each of those is a loopback round trip through gloo's threads; on a
small CPU machine the thread wake-ups cost far more than the sums. Where every rank of
the group runs on this host, rank 0 creates a segment under /dev/shm, the others map it
(its name goes round the group once, then it is unlinked: the mappings keep it), and the
call's thread 0 sums through it with no thread or process in between. Elsewhere
(ranks on several hosts, no /dev/shm) `connect` gives None and the caller keeps gloo.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
import tempfile

import torch

from kvserve.native import build
from kvserve.native.abi import ShmAllReduce

logger = logging.getLogger(__name__)

_FLAG_STRIDE = 64  # FLAG_STRIDE in native/csrc/comm/shm_all_reduce.c
_SHM_DIR = "/dev/shm"
# A rank waits this long for the others inside one all-reduce (as the TP group's collectives).
TIMEOUT_S = 600.0


class AllReduceError(RuntimeError):
    """A shared-memory all-reduce failed (a rank did not arrive in time, or too many elements)."""


def segment_bytes(world: int, capacity: int) -> int:
    """Bytes of a segment for `world` ranks and slots of `capacity` floats."""
    return world * _FLAG_STRIDE + 2 * world * capacity * 4


class SharedMemoryAllReduce:
    """One rank's mapping of the group's segment: `function` (the C all-reduce) called with
    `context` sums a float32 buffer of at most `capacity` elements over the ranks in place."""

    def __init__(self, path: str, rank: int, world: int, capacity: int, timeout_s: float = TIMEOUT_S) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), segment_bytes(world, capacity))
        self._anchor = ctypes.c_char.from_buffer(self._map)  # pins the mapping while the context points in
        self.capacity, self.timeout_s = capacity, timeout_s
        self.context = ShmAllReduce(base=ctypes.addressof(self._anchor), capacity=capacity, seq=0,
                                timeout_ns=int(timeout_s * 1e9), rank=rank, world=world)
        self.function = ctypes.cast(build.load_library().kvserve_shm_all_reduce, ctypes.c_void_p).value

    @classmethod
    def connect(cls, group, capacity: int) -> "SharedMemoryAllReduce | None":
        """The segment of the ranks of `group` (torch.distributed; every rank calls this
        together), or None where they are not all on this host or it has no /dev/shm."""
        lib = build.load_library()
        usable = lib is not None and os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK)
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        path = _create_segment(world, capacity) if rank == 0 and usable else None
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, (_host_id(), usable, path), group=group)
        if not all(usable for _, usable, _ in everyone) or len({host for host, _, _ in everyone}) != 1:
            if path:
                os.unlink(path)
            return None
        try:
            mapping = cls(everyone[0][2], rank, world, capacity)
        finally:
            torch.distributed.barrier(group=group)  # every rank mapped it (or failed): unlink the name
            if rank == 0:
                os.unlink(everyone[0][2])
        return mapping

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (float32, contiguous, CPU) summed over the ranks in place."""
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError("the shared-memory all-reduce takes a contiguous float32 CPU tensor")
        if build.load_library().kvserve_shm_all_reduce(ctypes.byref(self.context), tensor.data_ptr(),
                                                             tensor.numel()):
            self.raise_error()
        return tensor

    def raise_error(self) -> None:
        """Raises the failure the segment recorded (it stays failed: the ranks are out of step)."""
        if self.context.error == 1:
            raise AllReduceError(f"shared-memory all-reduce: more elements than the segment's {self.capacity}")
        raise AllReduceError(f"shared-memory all-reduce: the other ranks did not arrive within {self.timeout_s:g} s")


def _create_segment(world: int, capacity: int) -> str:
    fd, path = tempfile.mkstemp(prefix="kvserve-tp-", dir=_SHM_DIR)
    try:
        os.ftruncate(fd, segment_bytes(world, capacity))  # zero-filled: every flag at 0
    finally:
        os.close(fd)
    return path


def _host_id() -> str:
    """This host (and boot): ranks with the same id share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
