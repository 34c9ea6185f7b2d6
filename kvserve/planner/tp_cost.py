"""What tensor parallelism costs on a host, from a TP server's calibration against one rank's.

`kvserve bench plan-check --tp N` calibrates the step cost twice on the same
model (`calibrate.measure`): on a one-rank server whose torch threads are one
rank's share of the cores (one "device"), and on the `-tp N` server; and it
times all-reduces between N processes (`interconnect.measure_interconnect`).
For each step shape measured at TP N, what is left after the one-rank
overhead and the step's collectives (`plan.tp_comm_seconds` with the measured
link) is fitted as

    dispatch_overhead_s + work_scale * (one-rank work of that shape) / N

where `dispatch_overhead_s` is what each TP step pays to send the scheduler
output to N ranks and collect the result, and `work_scale` says how far one
rank's share of the work is from 1/N of the whole (1.0: a perfect split).
Both are non-negative least squares on relative error. `TPCost` carries them
and the link into `CalibratedStepCost`, the step cost `kvserve plan` uses for
TP > 1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvserve.planner.calibrate import CalibratedStepCost, Calibration, StepSample, fit_nonnegative
from kvserve.planner.interconnect import Interconnect
from kvserve.planner.plan import Machine, ModelSpec, tp_comm_seconds


@dataclass(frozen=True)
class TPCost:
    """The measured cost of TP on a host beyond the one-rank calibration."""

    tp: int
    dispatch_overhead_s: float
    work_scale: float
    interconnect: Interconnect

    def as_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "dispatch_overhead_s": self.dispatch_overhead_s, "work_scale": self.work_scale,
                "interconnect": self.interconnect.as_json()}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "TPCost":
        return cls(int(entry["tp"]), float(entry["dispatch_overhead_s"]), float(entry["work_scale"]),
                   Interconnect.from_json(entry["interconnect"]))


def with_interconnect(machine: Machine, interconnect: Interconnect) -> Machine:
    """`machine` with the measured link's latency and bandwidth."""
    from dataclasses import replace

    return replace(machine, interconnect_latency_us=interconnect.latency_us,
                   interconnect_gbs=interconnect.bandwidth_gbs)


def _sampled_rows(sample: StepSample) -> int:
    return sample.num_tokens if sample.kind == "decode" else 1


def _decode_tokens(sample: StepSample) -> int:
    return sample.num_tokens if sample.kind == "decode" else 0


def fit_tp_cost(one_rank: Calibration, at_tp: Calibration, tp: int, model: ModelSpec, machine: Machine,
                interconnect: Interconnect) -> TPCost:
    """Fit dispatch overhead and work scale of the TP server's samples (see the module docstring).
    `model.dtype_bytes` is the activations' width on the wire."""
    if tp < 2:
        raise ValueError("a TP cost needs tp >= 2")
    linked = with_interconnect(machine, interconnect)
    features, residuals = [], []
    for sample in at_tp.samples:
        work_s = (one_rank.seconds(sample.num_tokens, sample.num_context_tokens, _decode_tokens(sample))
                  - one_rank.overhead_s)
        comm_s = tp_comm_seconds(model, linked, tp, sample.num_tokens, _sampled_rows(sample))
        # What the collectives and the one-rank overhead leave of the measured step; kept
        # positive so the relative-error weights stay meaningful.
        residuals.append(max(sample.seconds - one_rank.overhead_s - comm_s, 1e-6))
        features.append([1.0, work_s / tp])
    if len(features) < 2:
        raise ValueError("a TP cost fit needs at least 2 samples of the TP server")
    dispatch_s, work_scale = fit_nonnegative(features, residuals)
    return TPCost(tp, dispatch_s, work_scale, interconnect)


def tp_step_cost(one_rank: Calibration, tp: int, model: ModelSpec, machine: Machine,
                 tp_cost: TPCost | None) -> CalibratedStepCost:
    """The step cost at `tp` from the one-rank calibration, with the measured TP cost when there is one
    (its link replaces the machine's only when `machine` does not name one; see plan_cli)."""
    if tp_cost is None or tp <= 1:
        return CalibratedStepCost(one_rank, tp, model, machine)
    return CalibratedStepCost(one_rank, tp, model, machine, tp_cost.dispatch_overhead_s, tp_cost.work_scale)


def tp_gap(one_rank: Calibration, at_tp: Calibration, cost: CalibratedStepCost) -> list[dict[str, Any]]:
    """Each TP-server sample: measured, the one-rank time of the same shape, and the TP model's."""
    rows = []
    for sample in at_tp.samples:
        decode = _decode_tokens(sample)
        rows.append({**asdict(sample),
                     "one_rank_s": one_rank.seconds(sample.num_tokens, sample.num_context_tokens, decode),
                     "tp_model_s": cost.seconds(sample.num_tokens, sample.num_context_tokens, decode,
                                                num_sampled=_sampled_rows(sample))})
    return rows
