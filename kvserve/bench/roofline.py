"""The physical limits of this machine for a given model: matmul FLOP rate and memory bandwidth.

A decode step multiplies every weight of the model once per token in the
batch. With `m` tokens in the step, the step's matmuls cost
`m * flops_per_token` and read every weight once, so:

- batched ceiling (large m): matmul FLOP rate / flops_per_token;
- single-stream ceiling (m = 1): memory read bandwidth / weight bytes (a
  step cannot finish before its weights have streamed from memory). The
  measured m = 1 pass shows how much of that torch's own kernels reach.

Both are measured here, on the model's own shapes, with distinct weights per
layer so that small models do not fit in cache by accident.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any, Callable

from kvserve.bench.model_info import ModelShapes
from kvserve.bench.report import format_table

DTYPES = ("float32", "bfloat16")
BATCH_SIZES = (1, 256)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def time_call(fn: Callable[[], Any], *, repeats: int, device: str, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds (after warm-up calls)."""
    for _ in range(warmup):
        fn()
    _synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _make_weights(shapes: ModelShapes, dtype, device: str) -> list:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(0)
    weights = []
    for _, in_features, out_features, count in shapes.linear_shapes():
        for _ in range(count):
            weight = torch.randn(out_features, in_features, generator=generator) * 0.02
            weights.append(weight.to(device=device, dtype=dtype))
    return weights


def measure_matmul_pass(shapes: ModelShapes, weights: list, m: int, *, repeats: int, device: str) -> dict[str, float]:
    """Time one pass of `m` tokens through every weight matmul of the model."""
    import torch

    dtype = weights[0].dtype
    inputs = {k: torch.randn(m, k).to(device=device, dtype=dtype) for k in {w.shape[1] for w in weights}}
    linear = torch.nn.functional.linear

    def one_pass() -> None:
        with torch.inference_mode():
            for weight in weights:
                linear(inputs[weight.shape[1]], weight)

    seconds = time_call(one_pass, repeats=repeats, device=device)
    flops = m * shapes.flops_per_token
    return {"m": m, "pass_s": seconds, "gflops": flops / seconds / 1e9, "tokens_per_s": m / seconds}


def measure_read_bandwidth(num_bytes: int, *, repeats: int, device: str) -> float:
    """Memory read bandwidth in GB/s from summing a buffer much larger than the caches."""
    import torch

    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    seconds = time_call(lambda: buffer.sum(), repeats=repeats, device=device)
    return buffer.numel() * 4 / seconds / 1e9


def run(shapes: ModelShapes, *, dtypes=DTYPES, batch_sizes=BATCH_SIZES, bandwidth_bytes: int = 512 << 20,
        repeats: int = 5, device: str = "cpu", num_threads: int | None = None) -> dict[str, Any]:
    """Measure matmul passes and bandwidth; derive the model's tokens/s ceilings per dtype."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    bandwidth_gbs = measure_read_bandwidth(bandwidth_bytes, repeats=repeats, device=device)
    by_dtype = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        weights = _make_weights(shapes, dtype, device)
        passes = [measure_matmul_pass(shapes, weights, m, repeats=repeats, device=device) for m in batch_sizes]
        del weights
        weight_bytes = shapes.matmul_params * dtype.itemsize
        for p in passes:
            p["weight_read_gb_per_s"] = weight_bytes / p["pass_s"] / 1e9
        single = next((p for p in passes if p["m"] == 1), None)
        largest = max(passes, key=lambda p: p["m"])
        by_dtype[dtype_name] = {
            "matmul": passes,
            "weight_bytes": weight_bytes,
            # The physical single-stream limit; torch's own m=1 kernels may fall well short of it.
            "single_stream_ceiling_tokens_per_s": bandwidth_gbs * 1e9 / weight_bytes,
            "torch_m1_matmul_tokens_per_s": single["tokens_per_s"] if single else None,
            "batched_ceiling_tokens_per_s": largest["tokens_per_s"],
            "batched_ceiling_m": largest["m"],
        }
    return {
        "model_shapes": asdict(shapes),
        "flops_per_token": shapes.flops_per_token,
        "matmul_params": shapes.matmul_params,
        "read_bandwidth_gb_per_s": bandwidth_gbs,
        "device": device,
        "threads": torch.get_num_threads(),
        "by_dtype": by_dtype,
    }


def format_result(result: dict[str, Any]) -> str:
    rows = []
    for dtype_name, entry in result["by_dtype"].items():
        for p in entry["matmul"]:
            rows.append([dtype_name, p["m"], p["gflops"], p["pass_s"] * 1000, p["tokens_per_s"],
                         p["weight_read_gb_per_s"]])
    matmuls = format_table(["dtype", "m", "GFLOP/s", "pass ms", "matmul tok/s", "weights GB/s"], rows,
                           title=f"roofline: model matmuls ({result['flops_per_token'] / 1e9:.3f} GFLOP/token, "
                                 f"{result['threads']} threads, {result['device']})")
    ceilings = format_table(
        ["dtype", "weights MB", "single-stream tok/s (bandwidth)", "torch m=1 tok/s",
         "batched m", "batched tok/s (compute)"],
        [[name, e["weight_bytes"] / 1e6, e["single_stream_ceiling_tokens_per_s"],
          e["torch_m1_matmul_tokens_per_s"], e["batched_ceiling_m"], e["batched_ceiling_tokens_per_s"]]
         for name, e in result["by_dtype"].items()],
        title=f"roofline: ceilings (memory read {result['read_bandwidth_gb_per_s']:.1f} GB/s)")
    return matmuls + "\n\n" + ceilings


def plot_values(result: dict[str, Any]) -> tuple[list[str], list[float]]:
    labels, values = [], []
    for dtype_name, entry in result["by_dtype"].items():
        labels += [f"{dtype_name} single", f"{dtype_name} batched"]
        values += [entry["single_stream_ceiling_tokens_per_s"], entry["batched_ceiling_tokens_per_s"]]
    return labels, values
