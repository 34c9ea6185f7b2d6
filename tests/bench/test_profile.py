"""The profile's attribution of time: C functions split by caller, matmuls by name."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import kvserve
from kvserve.bench.profile import categorize

# Frames are attributed by the installed package's own folder, so the fake frames live there.
PACKAGE_DIR = os.path.dirname(os.path.abspath(kvserve.__file__))
ATTENTION = (os.path.join(PACKAGE_DIR, "model", "attention.py"), 10, "paged_attention")
LAYERS = (os.path.join(PACKAGE_DIR, "model", "layers.py"), 20, "forward")
RUNNER = (os.path.join(PACKAGE_DIR, "worker", "model_runner.py"), 30, "execute_model")
SAMPLER = (os.path.join(PACKAGE_DIR, "sample", "sampler.py"), 40, "sample")
TORCH_MODULE = ("/site-packages/torch/nn/modules/module.py", 1, "_call_impl")
TORCH_OPS = ("/site-packages/torch/_ops.py", 2, "__call__")


def entry(self_s: float, callers: dict | None = None):
    return (1, 1, self_s, self_s, callers or {})


def test_c_function_time_is_split_by_caller_and_matmuls_by_name():
    stats = SimpleNamespace(stats={
        # torch.matmul: 0.5 s from attention (scores) and 2.0 s from the linear layers.
        ("~", 0, "<built-in method torch.matmul>"): entry(2.5, {ATTENTION: (1, 1, 0.5, 0.5),
                                                                 LAYERS: (1, 1, 2.0, 2.0)}),
        ("~", 0, "<method 'index_select' of 'torch._C.TensorBase' objects>"): entry(
            0.75, {ATTENTION: (1, 1, 0.5, 0.5), RUNNER: (1, 1, 0.25, 0.25)}),
        ("~", 0, "<built-in method torch.argmax>"): entry(0.125, {SAMPLER: (1, 1, 0.125, 0.125)}),
        # A prepacked oneDNN linear reached through torch's op wrappers is still a weight matmul.
        ("~", 0, "<built-in method torch._ops.mkldnn._linear_pointwise>"): entry(1.0, {TORCH_OPS: (1, 1, 1.0, 1.0)}),
        # The native small-batch matmul: its time is its ctypes wrapper's self time.
        ("/x/kvserve/native/cpu_kernels.py", 300, "small_linear"): entry(0.5),
        ATTENTION: entry(0.0625),
        RUNNER: entry(0.25),
        TORCH_MODULE: entry(0.5),
    })
    totals = categorize(stats)
    assert totals["matmul (weights)"] == pytest.approx(2.0 + 1.0 + 0.5)
    assert totals["attention"] == pytest.approx(0.5 + 0.5 + 0.0625)
    assert totals["worker: input preparation / output"] == pytest.approx(0.25 + 0.25)
    assert totals["sampling"] == pytest.approx(0.125)
    assert totals["torch Python wrappers"] == pytest.approx(0.5)
    assert sum(totals.values()) == pytest.approx(2.5 + 0.75 + 0.125 + 1.0 + 0.5 + 0.0625 + 0.25 + 0.5)


@pytest.mark.slow
def test_profile_under_tensor_parallelism_times_the_plain_steps(tmp_path):
    """`bench profile -tp 2`: the model runs in the worker processes, so only the plain step
    time is measured (and said so), with no profiler categories."""
    from tp.tp_helpers import save_tiny_model

    from kvserve.bench import profile
    path = save_tiny_model("llama_gqa", tmp_path / "llama")
    result = profile.run(model=path, tensor_parallel_size=2, device="cpu", batch_size=2, context_len=8, steps=3,
                         kv_cache_memory="8MiB")
    assert result["plain_step_ms"] > 0 and result["plain_decode_tokens_per_s"] > 0
    assert "categories" not in result and result["engine_kwargs"]["tensor_parallel_size"] == 2
    assert "tensor parallel: the ranks' processes are not profiled" in profile.format_result(result)
    assert profile.plot_values(result) == (["decode step"], [result["plain_step_ms"]])


def test_weights_file_mapping_sums_the_files_mappings(tmp_path):
    """`weights_file_mapping`: Rss and FilePmdMapped of every mapping of the file (a mapping split
    by advice into several entries counts whole), none of other files'; None where none maps it."""
    from kvserve.bench.profile import weights_file_mapping
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"\0")
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"7f0000000000-7f0000400000 r--p 00000000 fd:01 12 {weights}\nRss:                4096 kB\n"
        "FilePmdMapped:      2048 kB\nVmFlags: rd mr hg\n"
        f"7f0000400000-7f0000500000 r--p 00400000 fd:01 12 {weights}\nRss:                1024 kB\n"
        "FilePmdMapped:         0 kB\n"
        "7f0000500000-7f0000600000 r--p 00000000 fd:01 13 /other/file\nRss:                1024 kB\n"
        "FilePmdMapped:      1024 kB\n"
        "7f0000600000-7f0000700000 rw-p 00000000 00:00 0 \nRss:                  512 kB\n")
    assert weights_file_mapping(str(weights), str(smaps)) == {"rss_mib": 5.0, "pmd_mapped_mib": 2.0}
    assert weights_file_mapping("/not/mapped", str(smaps)) is None
    assert weights_file_mapping(str(weights), str(tmp_path / "missing")) is None
    if os.path.exists("/proc/self/smaps"):  # this process's own mapping of a real file
        import mmap
        weights.write_bytes(b"\1" * (1 << 20))
        with open(weights, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            assert sum(mapping[i] for i in range(0, 1 << 20, 4096)) == 256
            assert weights_file_mapping(str(weights))["rss_mib"] == 1.0
