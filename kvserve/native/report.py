"""`kvserve env`: what this machine offers the native kernels and what they chose, in
the spirit of `vllm collect-env` and llama.cpp's system_info: the CPU, the features
CPUID reports and those the OS enabled, the compiler and flags, the kernel cache,
torch, and the path each kernel takes under the current KVSERVE_* switches."""
from __future__ import annotations

import os
import platform
import sys

from kvserve.native import build, dispatch, isa
from kvserve.native.config import KernelConfig
from kvserve.paths import cache_root


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def _torch_version() -> str:
    try:
        import torch
        return f"{torch.__version__} ({torch.get_num_threads()} threads)"
    except ImportError:
        return "not installed"


def _chosen_paths(config: KernelConfig) -> dict[str, str | None]:
    """The path each kernel takes under `config` (None: the kernels are off or unavailable)."""
    if not config.cpu_kernels or build.load_library() is None:
        return {kernel: None for kernel in isa.KERNELS}
    paths = {kernel: dispatch.widest(kernel, config.quant_isa) for kernel in isa.KERNELS if kernel != "mask"}
    mask_cap = config.grammar_mask_isa
    paths["mask"] = None if mask_cap == "torch" else dispatch.widest("mask", mask_cap)
    return paths


def collect_env(environ=None) -> dict:
    """The report as a dict (what `kvserve env --json` prints, after the kvserve version)."""
    environ = os.environ if environ is None else environ
    config = KernelConfig.from_env(environ)
    features = build.probe_features()
    info = build.build_info() if config.cpu_kernels else None
    cc = build.compiler()
    return {
        "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": _torch_version(), "cpu": _cpu_model(), "machine": platform.machine(),
        "cpu_features": features.describe() if features else None,
        "xcr0": hex(features.xcr0) if features else None,
        "amx": {"usable": features.amx, "permission_granted": features.amx_permitted} if features else None,
        "compiler": info.compiler_version if info else (cc or "none found"),
        "compile_flags": list(info.flags) if info else None,
        "kernel_library": info.path if info else None,
        "kernel_cache": os.path.join(cache_root(), "kernels"),
        "kernel_paths": _chosen_paths(config),
        "switches": {name: value for name, value in sorted(environ.items()) if name.startswith("KVSERVE_")},
    }


def format_env(report: dict) -> str:
    """The report as aligned `name: value` lines."""
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{key}:")
            lines += [f"  {k}: {' '.join(v) if isinstance(v, list) else v}" for k, v in value.items()] or ["  (none)"]
        else:
            lines.append(f"{key}: {' '.join(value) if isinstance(value, list) else value}")
    return "\n".join(lines)
