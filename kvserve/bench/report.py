"""Shared pieces of every benchmark: latency statistics, tables, JSON and plots.

Benchmarks return plain JSON-able dicts; this module turns them into what a
person reads (a fixed-width table) and what a machine keeps (a JSON file and,
where a picture helps, a PNG).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

DEFAULT_RESULTS_DIR = "bench_results"
PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], pct: float) -> float:
    """Linear-interpolated percentile of already sorted values (numpy's default rule)."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = rank - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


@dataclass
class LatencyStats:
    """Summary of one latency metric, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def from_seconds(cls, values_s: Iterable[float]) -> "LatencyStats":
        ordered = sorted(v * 1000.0 for v in values_s)
        if not ordered:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            count=len(ordered),
            mean_ms=sum(ordered) / len(ordered),
            p50_ms=percentile(ordered, 50),
            p90_ms=percentile(ordered, 90),
            p99_ms=percentile(ordered, 99),
            max_ms=ordered[-1],
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def format_number(value: Any) -> str:
    """Numbers at a precision a person can read in a table; anything else as str."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if magnitude >= 0.1 or value == 0 else f"{value:.3g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None) -> str:
    """A fixed-width text table: first column left-aligned, the others right-aligned."""
    cells = [[format_number(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(values: Sequence[str]) -> str:
        parts = [values[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(values[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out.append(line(list(headers)))
    out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def environment_info() -> dict[str, Any]:
    """What a reader needs to judge a figure: machine, versions, threads, load at start."""
    info: dict[str, Any] = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    try:
        # Load average at start tells whether other work on the machine skewed the figures.
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    cpu_model = _cpu_model_name()
    if cpu_model:
        info["cpu_model"] = cpu_model
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def _cpu_model_name() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def default_output_path(benchmark: str, suffix: str, tag: str | None = None) -> Path:
    """bench_results/<benchmark>[-<tag>]<suffix>; a tag (e.g. a run's UTC time) keeps runs apart."""
    return Path(DEFAULT_RESULTS_DIR) / f"{benchmark}{'-' + tag if tag else ''}{suffix}"


def run_tag() -> str:
    """A name for one run: its UTC start time, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write the result with its environment; NaN becomes null so any JSON reader accepts it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(_nan_to_none(payload), indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return target


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def bar_plot(path: str | os.PathLike, labels: Sequence[str], values: Sequence[float], *,
             title: str, ylabel: str, reference_lines: dict[str, float] | None = None) -> Path:
    """One bar per label, optional horizontal lines (physical ceilings), saved as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(labels) + 2), 4.0))
    bars = ax.bar(range(len(labels)), [0.0 if math.isnan(v) else v for v in values], color="#4c72b0")
    ax.bar_label(bars, labels=[format_number(v) for v in values], fontsize=8)
    for name, level in (reference_lines or {}).items():
        ax.axhline(level, linestyle="--", linewidth=1, color="#c44e52")
        ax.annotate(f"{name} {format_number(level)}", (0, level), xytext=(2, 2),
                    textcoords="offset points", fontsize=8, color="#c44e52")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
