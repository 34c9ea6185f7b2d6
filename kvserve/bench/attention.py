"""Paged attention alone: the CPU kernel (csrc/attention/paged_attention.c) over a block-paged cache.

Decode steps (one query token per request) of `batch` requests with `context` keys
each, through `layers` separate KV caches (so the caches take the memory a model's
would, and a layer's K/V is not still in cache from the previous call), their blocks
scattered over the pool as a serving engine leaves them. For every case and KV dtype
and kernel path it reports the time per layer call, the K/V bytes read per second and
the attention FLOP rate (2 FLOPs per multiply-add of q.k and of p.V), to set against
the machine's memory bandwidth and matmul rate (`kvserve bench roofline`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from kvserve.native import cpu_kernels


@dataclass(frozen=True)
class AttentionCase:
    """One measured shape: `batch` decoding requests of `context` keys each."""

    batch: int
    context: int
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    layers: int = 30

    def flops_per_call(self) -> float:
        return 4.0 * self.batch * self.context * self.num_heads * self.head_dim


@dataclass
class _Inputs:
    caches: list[torch.Tensor]
    q: torch.Tensor
    out: torch.Tensor
    token_index: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    table_row: torch.Tensor


def _inputs(case: AttentionCase, kv_dtype: torch.dtype, seed: int) -> _Inputs:
    generator = torch.Generator().manual_seed(seed)
    blocks_per_request = -(-case.context // case.block_size)
    num_blocks = case.batch * blocks_per_request + 1  # block 0: the null block, never handed out
    shape = (2, case.num_kv_heads, num_blocks, case.block_size, case.head_dim)
    caches = [torch.randn(shape, generator=generator).to(kv_dtype) for _ in range(case.layers)]
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    block_table = order.view(case.batch, blocks_per_request).contiguous()
    q = torch.randn(case.batch, case.num_heads, case.head_dim, generator=generator)
    batch_index = torch.arange(case.batch, dtype=torch.int64)
    positions = torch.full((case.batch,), case.context - 1, dtype=torch.int64)
    return _Inputs(caches, q, torch.empty_like(q), batch_index, positions, block_table, batch_index.clone())


def _sweep(inputs: _Inputs, isa: str, scale: float) -> float:
    """Seconds for one call per layer, every layer once."""
    start = time.perf_counter()
    for cache in inputs.caches:
        cpu_kernels.paged_attention_cpu(inputs.q, cache, inputs.out, inputs.token_index, inputs.positions,
                                        inputs.block_table, inputs.table_row, None, scale, None, isa)
    return time.perf_counter() - start


def _measure(case: AttentionCase, kv_dtype: torch.dtype, isa: str, repeats: int) -> dict:
    inputs = _inputs(case, kv_dtype, seed=case.batch * 7919 + case.context)
    scale = case.head_dim ** -0.5
    _sweep(inputs, isa, scale)  # first touch, page faults
    per_call_s = statistics.median(_sweep(inputs, isa, scale) for _ in range(repeats)) / case.layers
    element_bytes = torch.empty(0, dtype=kv_dtype).element_size()
    kv_bytes = 2 * case.batch * case.context * case.num_kv_heads * case.head_dim * element_bytes
    return {"batch": case.batch, "context": case.context, "kv_dtype": str(kv_dtype).removeprefix("torch."),
            "isa": isa, "us_per_layer": round(per_call_s * 1e6, 2),
            "ms_per_step": round(per_call_s * case.layers * 1e3, 3),
            "kv_gb_per_s": round(kv_bytes / per_call_s / 1e9, 2),
            "gflop_per_s": round(case.flops_per_call() / per_call_s / 1e9, 2)}


def run(batch_sizes: tuple[int, ...] = (1, 32), context_lens: tuple[int, ...] = (64, 256, 512),
        kv_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16"), isas: tuple[str, ...] | None = None,
        num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64, block_size: int = 16, layers: int = 30,
        repeats: int = 20, threads: int | None = None) -> dict:
    """Every (batch, context) case, KV dtype and kernel path; `isas` None: the widest here."""
    if cpu_kernels.load_library() is None:
        raise RuntimeError("the CPU kernels could not be built (no C compiler?)")
    if threads:
        torch.set_num_threads(threads)
    isas = isas or (cpu_kernels.widest_attention_isa(),)
    unknown = [isa for isa in isas if isa not in cpu_kernels.ATTENTION_ISA_CODES]
    if unknown:
        raise ValueError(f"unknown kernel path(s) {unknown}; known: {list(cpu_kernels.ATTENTION_ISA_CODES)}")
    missing = [isa for isa in isas if not cpu_kernels.attention_isa_available(isa)]
    if missing:
        raise ValueError(f"kernel path(s) {missing} do not run on this CPU")
    dtypes = [getattr(torch, name) for name in kv_dtypes]
    rows = []
    for batch in batch_sizes:
        for context in context_lens:
            case = AttentionCase(batch, context, num_heads, num_kv_heads, head_dim, block_size, layers)
            # Alternate dtypes and paths within a case, so load drifts hit them alike.
            rows += [_measure(case, dtype, isa, repeats) for isa in isas for dtype in dtypes]
    return {"shape": {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                      "block_size": block_size, "layers": layers},
            "threads": torch.get_num_threads(), "repeats": repeats, "results": rows}


def format_result(result: dict) -> str:
    from kvserve.bench.report import format_table
    shape = result["shape"]
    rows = [[r["batch"], r["context"], r["kv_dtype"], r["isa"], r["us_per_layer"], r["ms_per_step"],
             r["kv_gb_per_s"], r["gflop_per_s"]] for r in result["results"]]
    title = (f"paged attention, decode: {shape['num_heads']} query heads on {shape['num_kv_heads']} KV heads of "
             f"{shape['head_dim']}, block {shape['block_size']}, {shape['layers']} layers, "
             f"{result['threads']} threads")
    return format_table(["batch", "context", "KV dtype", "path", "us/layer", "ms/step", "K/V GB/s", "GFLOP/s"],
                        rows, title=title)
