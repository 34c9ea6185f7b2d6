"""The engine over a 16-bit KV cache (`kv_cache_dtype`): the native decoder under async
scheduling, preemptions and prefix-cache hits against the same engine stepping
synchronously with room for every request and prefix caching off, over the same cache
dtype: same greedy and seeded tokens, no leaked block; and the CLI flag."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from engine_helpers import assert_pool_whole, make_engine, run_to_completion  # noqa: E402
from test_core import random_workload  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

from helpers.native_steps import count_native_steps  # noqa: E402
from kvserve.native import cpu_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")


def _kv_caches(core):
    return core.executor.model_runner.kv_caches


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_engine_on_16bit_cache_async_preemption_prefix_hits_equal_plain_run(tmp_path, monkeypatch, kv_cache_dtype):
    """Both engines run every step natively (a budget of 8 tokens) on kernels whose rows do
    not depend on the step's other rows, so the K/V a request writes are the same bits
    whichever step computes them: recomputed after preemption, served from the prefix
    cache or computed in a different batch. (The native decoder against the per-op path
    differs in float32 sum order, which a 16-bit cache can turn into near-tied flips.)"""
    path = save_tiny_model("llama", tmp_path / "llama")
    native_steps = count_native_steps(monkeypatch)
    prompts, params = random_workload(24, seed=5)
    prompts += [prompts[0][:40] + [5, 6, 7]] * 2  # prefix hits on a finished request's blocks
    params += params[:2]
    busy = make_engine(path, kv_cache_memory=30 * 1024, max_num_seqs=4, max_num_batched_tokens=8,
                       async_scheduling=True, kv_cache_dtype=kv_cache_dtype)
    plain = make_engine(path, max_num_seqs=4, max_num_batched_tokens=8, async_scheduling=False,
                        enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    try:
        for core in (busy, plain):
            assert {cache.dtype for cache in _kv_caches(core).values()} == {getattr(torch, kv_cache_dtype)}
        ours = run_to_completion(busy, prompts, params)
        stats = busy.get_stats()
        assert stats.num_preemptions > 0 and native_steps[0] > 50
        assert run_to_completion(plain, prompts, params) == ours
        assert plain.get_stats().num_preemptions == 0
        assert_pool_whole(busy)
    finally:
        busy.shutdown()
        plain.shutdown()


def test_kv_cache_dtype_flag_reaches_the_engine_config():
    import argparse

    from kvserve.engine.arg_utils import add_engine_arguments, engine_kwargs_from_args
    parser = add_engine_arguments(argparse.ArgumentParser())
    assert engine_kwargs_from_args(parser.parse_args(["--kv-cache-dtype", "float16"]))["kv_cache_dtype"] == "float16"
    assert "kv_cache_dtype" not in engine_kwargs_from_args(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
