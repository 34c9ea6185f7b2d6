"""The engine with the native decoder (small steps in one native call) against the
engine with it switched off: same greedy and seeded tokens under async scheduling,
chunked prompts of native size, preemptions and prefix-cache hits, no leaked block."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "worker"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from engine_helpers import assert_pool_whole, make_engine, run_to_completion  # noqa: E402
from test_core import random_workload  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

from helpers.native_steps import count_native_steps  # noqa: E402
from kvserve.model import native_decoder  # noqa: E402
from kvserve.native import cpu_kernels  # noqa: E402

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


def test_engine_batched_native_steps_equal_torch_path_over_quantized_weights(tmp_path, monkeypatch):
    """Steps of up to 48 tokens (many decodes, prompt chunks mixed in) over Q4_1 weights
    run natively with the panel GEMM; the engine with the native decoder off runs the same
    GEMM per op: same tokens under async scheduling, preemptions and prefix hits."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as QType
    from paged_kv_helper import load_hf

    from helpers.gguf_writer import write_gguf
    path = str(tmp_path / "tiny-q4_1.gguf")
    write_gguf(load_hf(save_tiny_model("llama", tmp_path / "llama")), path, QType.Q4_1)
    sizes: list[int] = []
    forward = native_decoder.NativeDecoder.forward

    def recording(self, hidden, *args, **kwargs):
        out = forward(self, hidden, *args, **kwargs)
        sizes.extend([hidden.shape[0]] if out is not None else [])
        return out
    monkeypatch.setattr(native_decoder.NativeDecoder, "forward", recording)
    prompts, params = random_workload(40, seed=7)
    prompts += [prompts[0][:40] + [5, 6, 7]] * 2  # prefix hits on a finished request's blocks
    params += params[:2]
    # Budget 48 (< the dense GEMM's rows): every step is one the native decoder takes. The
    # panel GEMM from one row on: its sums do not depend on the step's other rows, so the
    # two engines' different batches (async, preemptions) give the same numbers.
    monkeypatch.setenv("KVSERVE_QUANT_PANEL_ROWS", "1")
    # The per-op path's prompt chunks of more than 16 tokens would take the tiled prefill
    # kernel, whose float order is not the one-call decoder's token-by-token attention: keep
    # both on the attention they shared when this test's "same tokens" premise was set.
    monkeypatch.setenv("KVSERVE_PREFILL_ATTENTION", "0")
    native = make_engine(path, kv_cache_memory=90 * 1024, max_num_seqs=24, max_num_batched_tokens=48,
                         async_scheduling=True)
    monkeypatch.setenv("KVSERVE_NATIVE_DECODER", "0")
    torch_path = make_engine(path, max_num_seqs=24, max_num_batched_tokens=48, async_scheduling=False)
    try:
        ours = run_to_completion(native, prompts, params)
        assert native.get_stats().num_preemptions > 0 and sum(size > 8 for size in sizes) > 10
        steps_before = len(sizes)
        assert run_to_completion(torch_path, prompts, params) == ours
        assert len(sizes) == steps_before  # switched off: never ran
        assert_pool_whole(native)
    finally:
        native.shutdown()
        torch_path.shutdown()
