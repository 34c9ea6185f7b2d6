"""The cost of one all-reduce between TP ranks, measured with torch.distributed.

`world_size` processes on this host join a gloo group over loopback TCP (the
backend kvserve's CPU tensor parallelism uses), each with one torch thread,
and rank 0 times `all_reduce` of float32 tensors of several sizes (median of
`repeats`, after warm-up, each behind a barrier). A ring all-reduce of B bytes
over p ranks puts 2(p-1)/p * B on each link, so

    seconds = latency + 2(p-1)/p * B / bandwidth

is fitted by least squares (relative error, both terms non-negative). The
fitted latency and bandwidth are the `interconnect_latency_us` and
`interconnect_gbs` of `kvserve plan`'s machine description for this host.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MESSAGE_BYTES = (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
REPEATS = 30
WARMUP = 5


@dataclass(frozen=True)
class AllReduceSample:
    """The median time of one all-reduce of `message_bytes` over `world_size` ranks."""

    message_bytes: int
    seconds: float


@dataclass(frozen=True)
class Interconnect:
    """Latency and bandwidth of the links between ranks, fitted to all-reduce samples."""

    latency_s: float
    bandwidth_bytes_per_s: float
    world_size: int = 2
    backend: str = "gloo"
    samples: tuple[AllReduceSample, ...] = field(default=())

    @property
    def latency_us(self) -> float:
        return self.latency_s * 1e6

    @property
    def bandwidth_gbs(self) -> float:
        return self.bandwidth_bytes_per_s / 1e9

    def allreduce_seconds(self, message_bytes: int, world_size: int | None = None) -> float:
        p = world_size or self.world_size
        return self.latency_s + ring_bytes(message_bytes, p) / self.bandwidth_bytes_per_s

    def as_json(self) -> dict[str, Any]:
        return {"latency_us": self.latency_us, "bandwidth_gbs": self.bandwidth_gbs, "world_size": self.world_size,
                "backend": self.backend,
                "samples": [{**asdict(s), "fitted_s": self.allreduce_seconds(s.message_bytes)}
                            for s in self.samples]}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "Interconnect":
        samples = tuple(AllReduceSample(s["message_bytes"], s["seconds"]) for s in entry.get("samples", ()))
        return cls(entry["latency_us"] * 1e-6, entry["bandwidth_gbs"] * 1e9, entry.get("world_size", 2),
                   entry.get("backend", "gloo"), samples)


def ring_bytes(message_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `message_bytes`."""
    return 2 * (world_size - 1) / world_size * message_bytes


def fit_interconnect(samples: list[AllReduceSample], world_size: int, backend: str = "gloo") -> Interconnect:
    """Least squares on relative error; a term that would come out negative is dropped."""
    from kvserve.planner.calibrate import fit_nonnegative

    if len(samples) < 2:
        raise ValueError("an interconnect fit needs at least 2 message sizes")
    latency_s, seconds_per_byte = fit_nonnegative(
        [[1.0, ring_bytes(s.message_bytes, world_size)] for s in samples], [s.seconds for s in samples])
    # No measurable byte cost: a bandwidth far beyond any link (JSON has no infinity).
    bandwidth = 1.0 / seconds_per_byte if seconds_per_byte > 0 else 1e15
    return Interconnect(latency_s, bandwidth, world_size, backend, tuple(samples))


def _rank_main(rank: int, world_size: int, init_method: str, sizes: tuple[int, ...], repeats: int,
               queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        results = []
        for size in sizes:
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32)
            for _ in range(WARMUP):
                dist.all_reduce(tensor)
            times = []
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                dist.all_reduce(tensor)
                times.append(time.perf_counter() - started)
            results.append((size, statistics.median(times)))
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def measure_interconnect(world_size: int = 2, sizes: tuple[int, ...] = MESSAGE_BYTES, repeats: int = REPEATS,
                         timeout_s: float = 300.0) -> Interconnect:
    """Time gloo all-reduces over loopback between `world_size` processes and fit them."""
    import multiprocessing

    from kvserve.bench.replicas import free_port

    if world_size < 2:
        raise ValueError("an all-reduce needs world_size >= 2")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [context.Process(target=_rank_main, args=(rank, world_size, init_method, tuple(sizes), repeats,
                                                          queue), daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        results = queue.get(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - queue.Empty or a dead rank: say which
        codes = [p.exitcode for p in processes]
        raise RuntimeError(f"all-reduce measurement got no result in {timeout_s:.0f} s "
                           f"(rank exit codes {codes})") from exc
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return fit_interconnect([AllReduceSample(size, seconds) for size, seconds in results], world_size)


def load_interconnect(path: str) -> Interconnect:
    """The interconnect in a `kvserve bench allreduce` or `plan-check --tp` JSON."""
    from kvserve.planner.calibrate import load_result_entry

    return load_result_entry(path, "interconnect", Interconnect.from_json, "interconnect measurement")


def format_result(result: dict[str, Any]) -> str:
    """`kvserve bench allreduce`: each message size, measured and fitted, and the fit."""
    from kvserve.bench.report import format_table

    link = result["interconnect"]
    rows = [[s["message_bytes"], 1e6 * s["seconds"], 1e6 * s["fitted_s"]] for s in link["samples"]]
    return (format_table(["bytes", "measured us", "fitted us"], rows,
                         title=f"all-reduce over {link['world_size']} {link['backend']} ranks on loopback")
            + f"\n\nfit: {link['latency_us']:.1f} us + 2(p-1)/p * bytes at {link['bandwidth_gbs']:.3f} GB/s "
              "(kvserve plan --interconnect-json)")
