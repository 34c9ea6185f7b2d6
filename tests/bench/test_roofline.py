"""Roofline arithmetic against hand-counted shapes; a tiny measured run for sanity."""
from __future__ import annotations

import pytest

from kvserve.bench import roofline
from kvserve.bench.model_info import ModelShapes

SMOLLM2_135M = ModelShapes(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, vocab_size=49152)


def test_flops_and_weights_of_the_default_model_shapes():
    per_layer = 576 * (576 + 2 * 192) + 576 * 576 + 576 * 2 * 1536 + 1536 * 576
    assert SMOLLM2_135M.matmul_params == 30 * per_layer + 576 * 49152
    # DESIGN §5: about 0.27 GFLOP per token and 540 MB of float32 weights.
    assert SMOLLM2_135M.flops_per_token == pytest.approx(0.27e9, rel=0.01)
    assert SMOLLM2_135M.matmul_params * 4 == pytest.approx(540e6, rel=0.01)


def test_tiny_measured_run_is_consistent():
    shapes = ModelShapes(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, vocab_size=128)
    result = roofline.run(shapes, dtypes=("float32",), batch_sizes=(1, 8), bandwidth_bytes=1 << 20, repeats=1)
    entry = result["by_dtype"]["float32"]
    assert [p["m"] for p in entry["matmul"]] == [1, 8]
    for p in entry["matmul"]:
        assert p["gflops"] == pytest.approx(p["m"] * shapes.flops_per_token / p["pass_s"] / 1e9)
        assert p["tokens_per_s"] == pytest.approx(p["m"] / p["pass_s"])
    assert entry["weight_bytes"] == shapes.matmul_params * 4
    assert entry["single_stream_ceiling_tokens_per_s"] == pytest.approx(
        result["read_bandwidth_gb_per_s"] * 1e9 / entry["weight_bytes"])
    assert entry["batched_ceiling_m"] == 8
    assert "roofline" in roofline.format_result(result)


def test_kernel_passes_time_every_weight_shape():
    shapes = ModelShapes(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, vocab_size=128)
    result = roofline.run(shapes, dtypes=("float32",), batch_sizes=(3,), bandwidth_bytes=1 << 20, repeats=1,
                          kernels=("torch", "f32-panels"))
    passes = result["by_dtype"]["float32"]["kernel_passes"]
    assert passes and {p["kernel"] for p in passes} <= {"torch", "f32-panels"} and passes[0]["kernel"] == "torch"
    for p in passes:
        assert [(s["name"], s["in_features"], s["out_features"], s["count"]) for s in p["by_shape"]] == \
            shapes.linear_shapes()
        for s in p["by_shape"]:
            flops = 2 * 3 * s["in_features"] * s["out_features"] * s["count"]
            assert s["gflops"] == pytest.approx(flops / (s["ms"] / 1000) / 1e9)
        assert p["pass_s"] == pytest.approx(sum(s["ms"] for s in p["by_shape"]) / 1000)
        assert p["gflops"] == pytest.approx(3 * shapes.flops_per_token / p["pass_s"] / 1e9)
    assert "matmul kernels by weight shape" in roofline.format_result(result)
    with pytest.raises(ValueError, match="unknown matmul kernels"):
        roofline.run(shapes, dtypes=("float32",), batch_sizes=(1,), bandwidth_bytes=1 << 20, repeats=1,
                     kernels=("mkl",))
