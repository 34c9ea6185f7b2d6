"""The engine with the native decoder (small steps in one native call) against the
engine with it switched off: same greedy and seeded tokens under async scheduling,
chunked prompts of native size, preemptions and prefix-cache hits, no leaked block."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
from engine_helpers import assert_pool_whole, make_engine, run_to_completion  # noqa: E402
from test_core import random_workload  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

from helpers.native_steps import count_native_steps  # noqa: E402
from kvserve.model import cpu_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_engine_native_decoder_equals_torch_path(tmp_path, monkeypatch, family):
    path = save_tiny_model(family, tmp_path / family)
    native_steps = count_native_steps(monkeypatch)
    prompts, params = random_workload(24, seed=5)
    prompts += [prompts[0][:40] + [5, 6, 7]] * 2  # prefix hits on a finished request's blocks
    params += params[:2]
    # Budget 8: every step, prompt chunks included, is one the native decoder takes.
    native = make_engine(path, kv_cache_memory=60 * 1024, max_num_seqs=4, max_num_batched_tokens=8,
                         async_scheduling=True)
    monkeypatch.setenv("KVSERVE_NATIVE_DECODER", "0")
    torch_path = make_engine(path, max_num_seqs=4, async_scheduling=False)
    try:
        ours = run_to_completion(native, prompts, params)
        assert native.get_stats().num_preemptions > 0 and native_steps[0] > 50
        steps_before = native_steps[0]
        assert run_to_completion(torch_path, prompts, params) == ours
        assert native_steps[0] == steps_before  # switched off: never ran
        assert_pool_whole(native)
    finally:
        native.shutdown()
        torch_path.shutdown()
