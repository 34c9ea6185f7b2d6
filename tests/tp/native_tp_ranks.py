"""Tensor-parallel ranks without an engine: `run_ranks` spawns one process per rank,
joins them in a gloo group on loopback and runs a function on every rank; and the
native-decoder comparison each rank runs (`native_vs_torch`).

The case functions run in the spawned processes, so they live here (importable by
name) rather than in a test module, and return plain data (no tensors) to the parent.
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import traceback
from dataclasses import dataclass, field

RANK_TIMEOUT_S = 240


def _rank_main(rank: int, world_size: int, init_file: str, fn, args, results) -> None:
    import torch

    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                             world_size=world_size)
        try:
            results.put((rank, fn(rank, world_size, *args), None))
        finally:
            torch.distributed.destroy_process_group()
    except BaseException:
        results.put((rank, None, traceback.format_exc(limit=20)))


def run_ranks(fn, *args, world_size: int = 2) -> list:
    """`fn(rank, world_size, *args)` on every rank of a fresh gloo group, each in its own
    process; the results by rank. A rank that raised fails the call with its traceback."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        processes = [context.Process(target=_rank_main, args=(rank, world_size, init_file, fn, args, results))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        by_rank, errors = {}, []
        try:
            for _ in processes:
                rank, value, error = results.get(timeout=RANK_TIMEOUT_S)
                by_rank[rank] = value
                if error:
                    errors.append(f"rank {rank}:\n{error}")
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
                    process.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [by_rank[rank] for rank in range(world_size)]


@dataclass(frozen=True)
class Case:
    """One comparison: the model at `path`, prompts run greedily for `max_new_tokens`
    with prompt chunks of `chunk` tokens; `threads`: the native call's thread count
    (None: its own choice); `quant_isa`: KVSERVE_QUANT_ISA for both paths;
    `prefix_hit`: the prompts reuse a cached prefix, one through a copy-on-write block;
    `shm`: the call all-reduces through shared memory (else through gloo)."""

    name: str
    path: str
    lengths: tuple[int, ...] = (5, 19, 30)
    max_new_tokens: int = 64
    chunk: int = 2
    threads: int | None = None
    quant_isa: str | None = None
    prefix_hit: bool = False
    shm: bool = True


@dataclass
class Outcome:
    """What one rank saw in one case: the native path's greedy tokens by request and those the
    torch path was fed (the same: teacher forced, so a near-tie is no failure), the largest
    logits difference relative to the torch path's scale (at least 1), the steps the
    native call ran and the all-reduces it made (through shared memory: `shm`), the
    model's layers. Quantized weights only: `rounding_bound`, what int8 activation rounding
    allows any logit to move from the float32 model's (`reference_deviation`: native path,
    torch path), and `max_logit_diff`, the largest absolute difference of the two paths."""

    tokens: dict = field(default_factory=dict)
    torch_tokens: dict = field(default_factory=dict)
    max_rel_logit_diff: float = 0.0
    max_logit_diff: float = 0.0
    rounding_bound: float | None = None
    reference_deviation: tuple[float, float] = (0.0, 0.0)
    native_steps: int = 0
    native_all_reduces: int = 0
    num_layers: int = 0
    shm: bool = False


def _prompts(lengths, seed: int) -> dict[str, list[int]]:
    import torch
    from model.paged_kv_helper import VOCAB

    generator = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate(lengths)}


def _greedy(case: Case, model, follow: dict | None = None) -> tuple[dict, dict]:
    from kvserve.kv_cache.utils import KVCacheBlockCopy
    from model.paged_kv_helper import PagedRunner, run_greedy

    runner = PagedRunner(model, block_size=4)
    if not case.prefix_hit:
        return run_greedy(runner, _prompts(case.lengths, seed=1), case.max_new_tokens, chunk=case.chunk,
                          follow=follow)
    base, tail = _prompts([22], seed=1)["r0"], _prompts([9], seed=2)["r0"]
    run_greedy(runner, {"a": base}, 1, chunk=64)
    shared = runner.requests["a"].block_ids
    own = [runner.new_block() for _ in shared]
    runner.copy_blocks([KVCacheBlockCopy(g, shared[g][4], own[g], 2) for g in range(len(shared))])
    runner.add("c", base[:18] + tail, shared_blocks=[t[:4] + [own[g]] for g, t in enumerate(shared)], num_computed=18)
    runner.add("b", base[:16] + tail, shared_blocks=[t[:4] for t in shared], num_computed=16)
    return run_greedy(runner, {"b": base[:16] + tail, "c": base[:18] + tail}, case.max_new_tokens, chunk=case.chunk,
                      follow=follow)


def _counting_native(model, outcome: Outcome) -> None:
    """Counts, into `outcome`, the steps the model's native decoder ran and the all-reduces
    made on its buffer (from inside the call)."""
    import torch

    from kvserve.model.native_decoder import NativeDecoder

    decoder = model._native = NativeDecoder.for_model(model)
    if decoder is None:
        return
    forward = decoder.forward

    def counting_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        outcome.native_steps += out is not None
        outcome.shm = decoder._reduce is not None and decoder._reduce.shared is not None
        if outcome.shm:
            outcome.native_all_reduces = decoder._reduce.shared.context.seq
        return out
    decoder.forward = counting_forward
    if decoder._reduce is None or decoder._reduce.shared is not None:
        return
    all_reduce, buffer = torch.distributed.all_reduce, decoder._reduce.buffer

    def counting_all_reduce(tensor, *args, **kwargs):
        outcome.native_all_reduces += tensor.data_ptr() == buffer.data_ptr()
        return all_reduce(tensor, *args, **kwargs)
    torch.distributed.all_reduce = counting_all_reduce  # this rank's process only


def native_vs_torch(rank: int, world_size: int, cases: list[Case]) -> dict[str, Outcome]:
    """On one rank: each case's model (this rank's shard) through the native decoder and
    through the per-op torch path."""
    import torch

    from kvserve.native.config import KernelConfig
    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import load_model

    outcomes = {}
    for case in cases:
        config = ModelConfig.from_path(case.path)
        quantized = case.path.endswith(".gguf")
        # Quantized: every step on the int8 row kernel (no bfloat16 panel or dense GEMM, another
        # model of error), so that both paths are int8 roundings of the same float32 model.
        row_kernel = dict(quant_panel_rows=0, quant_gemm_rows=0) if quantized else {}
        kernels = KernelConfig(quant_isa=case.quant_isa, shm_all_reduce=case.shm, **row_kernel)
        outcome = Outcome()
        model = load_model(config, tp_rank=rank, tp_size=world_size, kernel_config=kernels)
        outcome.num_layers = len(model.layers)
        all_reduce = torch.distributed.all_reduce
        try:
            _counting_native(model, outcome)
            if case.threads and model._native is not None:
                model._native.num_threads = case.threads
            outcome.tokens, logits = _greedy(case, model)
        finally:
            torch.distributed.all_reduce = all_reduce
        reference = load_model(config, tp_rank=rank, tp_size=world_size, kernel_config=kernels)
        reference._native = None  # decided: the per-op path
        # Teacher forced: the per-op path is fed the native path's tokens (two float orders: a
        # near-tie may break either way, so their own greedy tokens are not compared).
        outcome.torch_tokens, ref_logits = _greedy(case, reference, outcome.tokens)
        for req_id, rows in ref_logits.items():
            for a, b in zip(logits[req_id], rows):
                diff = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
                outcome.max_rel_logit_diff = max(outcome.max_rel_logit_diff, diff)
                outcome.max_logit_diff = max(outcome.max_logit_diff, (a - b).abs().max().item())
        if quantized:
            _against_float32(case, rank, world_size, kernels, reference, outcome, logits, ref_logits)
        outcomes[case.name] = outcome
    return outcomes


def _against_float32(case: Case, rank: int, world_size: int, kernels, held, outcome: Outcome,
                     logits: dict, ref_logits: dict) -> None:
    """Both paths' logits (fed the same tokens) against this rank's shard of the float32 model
    (the GGUF dequantized), within the bound int8 activation rounding allows
    (tests/helpers/activation_rounding.py), into `outcome`."""
    import torch

    from helpers.activation_rounding import max_deviation, quantized_half_steps, rounding_bound
    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import load_model
    from model.paged_kv_helper import every_token_logits

    prompts = _prompts(case.lengths, seed=1)
    sequences = {r: prompt + outcome.tokens[r][:-1] for r, prompt in prompts.items()}
    prompt_lens = {r: len(prompt) for r, prompt in prompts.items()}
    plain = load_model(ModelConfig.from_path(case.path, quantization="none", dtype="float32"), tp_rank=rank,
                       tp_size=world_size, kernel_config=kernels)
    plain._native = None  # decided: the per-op path, in float32
    reference, outcome.rounding_bound = rounding_bound(
        plain, quantized_half_steps(plain, held), lambda m: every_token_logits(m, sequences, prompt_lens))
    outcome.reference_deviation = (max_deviation({r: torch.stack(rows) for r, rows in logits.items()}, reference),
                                   max_deviation({r: torch.stack(rows) for r, rows in ref_logits.items()}, reference))


def failing_all_reduce(rank: int, world_size: int, path: str, fail_at: int) -> dict:
    """On one rank: the native call's all-reduce number `fail_at` raises (on every rank, so
    that none waits for the others). What the step raised, and whether the next steps run."""
    import torch

    from kvserve.native.config import KernelConfig
    from kvserve.model.config import ModelConfig
    from kvserve.model.loader import load_model
    from kvserve.model.native_decoder import NativeDecoder
    from model.paged_kv_helper import PagedRunner, run_greedy

    model = load_model(ModelConfig.from_path(path), tp_rank=rank, tp_size=world_size,
                       kernel_config=KernelConfig(shm_all_reduce=False))  # gloo: the failure is injected there
    model._native = NativeDecoder.for_model(model)
    buffer, all_reduce, calls = model._native._reduce.buffer, torch.distributed.all_reduce, [0]

    def failing(tensor, *args, **kwargs):
        if tensor.data_ptr() == buffer.data_ptr():
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("injected all-reduce failure")
        return all_reduce(tensor, *args, **kwargs)
    torch.distributed.all_reduce = failing
    runner = PagedRunner(model, block_size=4)
    raised = None
    try:
        run_greedy(runner, {"a": [5, 6, 7]}, 4, chunk=2)
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        torch.distributed.all_reduce = all_reduce
    tokens, _ = run_greedy(PagedRunner(model, block_size=4), {"b": [5, 6, 7]}, 4, chunk=2)
    return {"raised": raised, "calls": calls[0], "tokens_after": tokens["b"]}


def shm_sums(rank: int, world_size: int, counts: list[int]) -> list[bool]:
    """On one rank: all-reduces of `counts` elements through the group's shared-memory segment
    (rank r's part drawn from seed 100 * step + r, so every rank knows every part), each
    against the parts summed in rank order in float32 and, for two ranks, against gloo's sum."""
    import torch

    from kvserve.model.shm_all_reduce import SharedMemoryAllReduce

    shared = SharedMemoryAllReduce.connect(None, max(counts))
    assert shared is not None, "every rank of the group is on this host"
    agree = []
    for step, count in enumerate(counts):
        parts = [torch.randn(count, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world_size)]
        expected = parts[0].clone()
        for part in parts[1:]:
            expected += part
        got = shared.all_reduce(parts[rank].clone())
        same = torch.equal(got, expected)
        if world_size == 2:
            gloo = parts[rank].clone()
            torch.distributed.all_reduce(gloo)
            same = same and torch.equal(got, gloo)
        agree.append(same)
    return agree
