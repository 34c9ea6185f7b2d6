"""The as-stored GGUF matmul kernels alone (csrc/linear/gguf_rows.c): weight bytes read per
second for one matrix shape per block type, kernel path, batch and thread count, against
the machine's memory read bandwidth (measured here as `kvserve bench roofline` does).

Single-stream decode reads every weight byte once per token, so GB/s of weight bytes is
the figure that matters at batch 1; at larger batches the same bytes serve more rows. The
matrices are several copies of the shape, together `footprint_mb` (well above the last-level
cache), called in turn, so each call reads its weight from memory as a model's layers do.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kvserve.bench.roofline import measure_read_bandwidth
from kvserve.model import stored_weight
from kvserve.native import cpu_kernels, dispatch
from kvserve.native.isa import ISA_CODES

# Block bytes and where their f16 scale fields lie (set to a moderate value: random bytes
# would make NaNs and subnormals, which some CPUs compute slowly).
_F16_FIELDS = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q8_0": (34, (0,)), "Q4_K": (144, (0, 2)),
               "Q6_K": (210, (208,)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)), "Q5_K": (176, (0, 2)),
               "Q3_K": (110, (108,)), "Q2_K": (84, (80, 82)), "IQ4_NL": (18, (0,)), "IQ4_XS": (136, (0,))}
_SCALE_BITS = np.array([0.01], dtype=np.float16).view(np.uint8)
# Types whose block scale is an E8M0 exponent byte (first byte): 122, a scale of 2^-6.
_E8M0_BLOCKS = {"MXFP4": 17}
_E8M0_SCALE = 122


def _random_blocks(type_name: str, rows: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    raw = rng.integers(0, 256, (rows, stored_weight.row_bytes(type_name, in_features)), dtype=np.uint8)
    if type_name in _E8M0_BLOCKS:
        raw.reshape(rows, -1, _E8M0_BLOCKS[type_name])[..., 0] = _E8M0_SCALE
        return torch.from_numpy(raw)
    block_bytes, fields = _F16_FIELDS[type_name]
    blocks = raw.reshape(rows, -1, block_bytes)
    for offset in fields:
        blocks[..., offset:offset + 2] = _SCALE_BITS
    return torch.from_numpy(raw)


def _measure(weights: list[stored_weight.StoredWeight], batch: int, isa: str, repeats: int) -> float:
    """Median seconds of one call, each call on the next copy of the weight."""
    lib = cpu_kernels.load_library()
    first = weights[0]
    x = torch.randn(batch, first.in_features, generator=torch.Generator().manual_seed(batch))
    y = torch.empty(batch, first.out_features)
    code = ISA_CODES[isa]

    def sweep() -> float:
        start = time.perf_counter()
        for w in weights:
            lib.kvserve_gguf_linear(x.data_ptr(), x.stride(0), batch, w.blocks.data_ptr(), w.ggml_type,
                                    w.in_features, None, y.data_ptr(), w.out_features, code)
        return (time.perf_counter() - start) / len(weights)

    sweep()  # first touch
    return statistics.median(sweep() for _ in range(repeats))


def run(types: tuple[str, ...] = ("Q4_K", "Q6_K"), out_features: int = 2048, in_features: int = 8192,
        batch_sizes: tuple[int, ...] = (1,), threads: tuple[int, ...] = (1, 2), isas: tuple[str, ...] | None = None,
        footprint_mb: int = 256, repeats: int = 10) -> dict:
    """Every type x path x thread count x batch; `isas` None: the widest path here."""
    if cpu_kernels.load_library() is None:
        raise RuntimeError("the CPU kernels could not be built (no C compiler?)")
    known = {*_F16_FIELDS, *_E8M0_BLOCKS}
    unknown = [name for name in types if name not in known]
    if unknown:
        raise ValueError(f"no benchmark weights for {unknown}; known: {sorted(known)}")
    isas = isas or (dispatch.widest("quant"),)
    strange = [isa for isa in isas if isa not in ISA_CODES]
    if strange:
        raise ValueError(f"unknown kernel path(s) {strange}; known: {list(ISA_CODES)}")
    missing = [isa for isa in isas if not dispatch.available("quant", isa)]
    if missing:
        raise ValueError(f"kernel path(s) {missing} do not run on this CPU")
    saved_threads = torch.get_num_threads()
    bandwidth = {}
    rows = []
    rng = np.random.default_rng(0)
    try:
        for count in threads:
            torch.set_num_threads(count)
            bandwidth[count] = measure_read_bandwidth(footprint_mb << 20, repeats=repeats, device="cpu")
        for type_name in types:
            nbytes = out_features * stored_weight.row_bytes(type_name, in_features)
            copies = max(2, -(-(footprint_mb << 20) // nbytes))
            weights = [stored_weight.from_gguf_blocks(type_name, _random_blocks(type_name, out_features, in_features,
                                                                                 rng), in_features)
                       for _ in range(copies)]
            for isa in isas:
                for count in threads:
                    torch.set_num_threads(count)
                    for batch in batch_sizes:
                        seconds = _measure(weights, batch, isa, repeats)
                        gbs = nbytes / seconds / 1e9
                        rows.append({"type": type_name, "isa": isa, "threads": count, "batch": batch,
                                     "us_per_call": round(seconds * 1e6, 1), "weight_gb_per_s": round(gbs, 2),
                                     "read_bandwidth_gb_per_s": round(bandwidth[count], 2),
                                     "pct_of_bound": round(100 * gbs / bandwidth[count], 1)})
            del weights
    finally:
        torch.set_num_threads(saved_threads)
    return {"shape": [out_features, in_features], "footprint_mb": footprint_mb, "repeats": repeats,
            "note": "indicative on a shared machine; the bound is torch's sum over a buffer of the footprint",
            "results": rows}


def format_result(result: dict) -> str:
    from kvserve.bench.report import format_table
    rows = [[r["type"], r["isa"], r["threads"], r["batch"], r["us_per_call"], r["weight_gb_per_s"],
             r["read_bandwidth_gb_per_s"], r["pct_of_bound"]] for r in result["results"]]
    out, inp = result["shape"]
    return format_table(["type", "path", "threads", "batch", "us/call", "weights GB/s", "read GB/s", "% of bound"],
                        rows, title=f"GGUF blocks as stored: {out}x{inp} matrices, {result['footprint_mb']} MB "
                                    f"cycled")
