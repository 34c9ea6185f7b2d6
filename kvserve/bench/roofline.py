"""The physical limits of this machine for a given model: matmul FLOP rate and memory bandwidth.

A decode step multiplies every weight of the model once per token in the
batch. With `m` tokens in the step, the step's matmuls cost
`m * flops_per_token` and read every weight once, so:

- batched ceiling (large m): matmul FLOP rate / flops_per_token;
- single-stream ceiling (m = 1): memory read bandwidth / weight bytes (a
  step cannot finish before its weights have streamed from memory). The
  measured m = 1 pass shows how much of that torch's own kernels reach.

Both are measured here, on the model's own shapes, with distinct weights per
layer so that small models do not fit in cache by accident. With `kernels`, each
weight shape is also timed on its own through each named matmul kernel (torch's
`F.linear`, oneDNN on a packed weight, kvserve's float32 panel GEMM), so a
kernel's GFLOP/s per shape can be set against torch's and against the ceiling.
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
# Matmul kernels `run(kernels=...)` times shape by shape: torch's F.linear on the plain
# weight, oneDNN's packed weight (CPU), kvserve's float32 panels (csrc/linear/f32_gemm.c).
KERNELS = ("torch", "onednn", "f32-panels")


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


def _kernel_linear(kernel: str, weight) -> Callable[[Any], Any] | None:
    """x -> x @ weight^T through `kernel` (the weight prepared once, as a model holds it), or
    None where the kernel does not take this weight here."""
    import torch
    import torch.nn.functional as F

    on_cpu = weight.device.type == "cpu"
    if kernel == "torch":
        return lambda x: F.linear(x, weight)
    if kernel == "onednn" and on_cpu and torch.backends.mkldnn.is_available() and \
            weight.dtype in (torch.float32, torch.bfloat16):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kernel == "f32-panels" and on_cpu and weight.dtype == torch.float32:
        from kvserve.model import native_decoder, quantized
        from kvserve.native import cpu_kernels

        isa = native_decoder.f32_gemm_isa()
        if isa is None:
            return None
        panels, out_features = cpu_kernels.pack_f32_panels(weight.contiguous()), weight.shape[0]
        return lambda x: cpu_kernels.f32_gemm(x, panels, out_features, quantized.ISA_CODES[isa])
    return None


def measure_kernel_pass(shapes: ModelShapes, weights: list, m: int, kernel: str, *, repeats: int,
                        device: str) -> dict[str, Any] | None:
    """Time `m` tokens through each weight shape of the model (all of its layers' distinct
    weights) with `kernel`; None where the kernel does not take these weights."""
    import torch

    linears = [_kernel_linear(kernel, w) for w in weights]
    if any(fn is None for fn in linears):
        return None
    by_shape, first = [], 0
    for name, in_features, out_features, count in shapes.linear_shapes():
        group, first = linears[first:first + count], first + count
        x = torch.randn(m, in_features).to(device=device, dtype=weights[0].dtype)

        def shape_pass(group=group, x=x) -> None:
            with torch.inference_mode():
                for fn in group:
                    fn(x)

        seconds = time_call(shape_pass, repeats=repeats, device=device)
        flops = 2 * m * in_features * out_features * count
        by_shape.append({"name": name, "in_features": in_features, "out_features": out_features, "count": count,
                         "ms": seconds * 1000, "gflops": flops / seconds / 1e9})
    pass_s = sum(s["ms"] for s in by_shape) / 1000
    return {"kernel": kernel, "m": m, "pass_s": pass_s, "gflops": m * shapes.flops_per_token / pass_s / 1e9,
            "by_shape": by_shape}


def measure_read_bandwidth(num_bytes: int, *, repeats: int, device: str) -> float:
    """Memory read bandwidth in GB/s from summing a buffer much larger than the caches."""
    import torch

    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    seconds = time_call(lambda: buffer.sum(), repeats=repeats, device=device)
    return buffer.numel() * 4 / seconds / 1e9


def run(shapes: ModelShapes, *, dtypes=DTYPES, batch_sizes=BATCH_SIZES, bandwidth_bytes: int = 512 << 20,
        repeats: int = 5, device: str = "cpu", num_threads: int | None = None, kernels=()) -> dict[str, Any]:
    """Measure matmul passes and bandwidth; derive the model's tokens/s ceilings per dtype.
    `kernels` (names of KERNELS) adds each kernel's time per weight shape (`kernel_passes`)."""
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown matmul kernels {sorted(unknown)}; choose from {KERNELS}")
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    bandwidth_gbs = measure_read_bandwidth(bandwidth_bytes, repeats=repeats, device=device)
    by_dtype = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        weights = _make_weights(shapes, dtype, device)
        passes = [measure_matmul_pass(shapes, weights, m, repeats=repeats, device=device) for m in batch_sizes]
        kernel_passes = [p for m in batch_sizes for kernel in kernels
                         if (p := measure_kernel_pass(shapes, weights, m, kernel, repeats=repeats, device=device))]
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
            "kernel_passes": kernel_passes,
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
    by_kernel = [[name, p["kernel"], p["m"], s["name"], f"{s['in_features']}x{s['out_features']}", s["count"],
                  s["ms"], s["gflops"]]
                 for name, e in result["by_dtype"].items() for p in e.get("kernel_passes", ()) for s in p["by_shape"]]
    if not by_kernel:
        return matmuls + "\n\n" + ceilings
    kernels = format_table(["dtype", "kernel", "m", "weight", "in x out", "layers", "ms", "GFLOP/s"], by_kernel,
                           title="roofline: matmul kernels by weight shape (each shape's layers, distinct weights)")
    return matmuls + "\n\n" + ceilings + "\n\n" + kernels


def plot_values(result: dict[str, Any]) -> tuple[list[str], list[float]]:
    labels, values = [], []
    for dtype_name, entry in result["by_dtype"].items():
        labels += [f"{dtype_name} single", f"{dtype_name} batched"]
        values += [entry["single_stream_ceiling_tokens_per_s"], entry["batched_ceiling_tokens_per_s"]]
    return labels, values
