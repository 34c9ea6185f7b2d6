"""The shared-memory all-reduce of the tensor-parallel ranks of one host
(kvserve/model/shm_all_reduce.py, csrc/comm/shm_all_reduce.c): the parts' float32 sum in rank
order on every rank (for two ranks, gloo's sum to the bit) over many calls of changing
sizes (both slot sets reused), and a clear error, never a hang, when a rank does not come."""
from __future__ import annotations

import os

import pytest
import torch

from native_tp_ranks import run_ranks, shm_sums
from kvserve.native import cpu_kernels
from kvserve.model.shm_all_reduce import AllReduceError, SharedMemoryAllReduce, _create_segment

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")

COUNTS = [1, 576, 7, 4096, 0, 33, 4096, 2, 1000, 576, 576, 3]


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_rank_gets_the_sum_in_rank_order(world_size):
    for rank, agree in enumerate(run_ranks(shm_sums, COUNTS, world_size=world_size)):
        assert agree == [True] * len(COUNTS), f"rank {rank}"


def test_a_rank_that_never_comes_is_a_timeout_error_and_the_segment_stays_failed():
    path = _create_segment(2, 64)
    try:
        rank0 = SharedMemoryAllReduce(path, rank=0, world=2, capacity=64, timeout_s=0.05)
    finally:
        os.unlink(path)
    with pytest.raises(AllReduceError, match="did not arrive within 0.05 s"):
        rank0.all_reduce(torch.ones(8))
    with pytest.raises(AllReduceError, match="did not arrive"):  # out of step: no second try
        rank0.all_reduce(torch.ones(8))


def test_more_elements_than_the_segment_holds_and_bad_tensors_are_errors():
    path = _create_segment(1, 16)
    try:
        alone = SharedMemoryAllReduce(path, rank=0, world=1, capacity=16)
    finally:
        os.unlink(path)
    x = torch.arange(16, dtype=torch.float32)
    assert torch.equal(alone.all_reduce(x.clone()), x)  # one rank: the sum is its own part
    with pytest.raises(ValueError, match="contiguous float32"):
        alone.all_reduce(torch.ones(4, dtype=torch.float64))
    with pytest.raises(AllReduceError, match="more elements than the segment's 16"):
        alone.all_reduce(torch.ones(17))
