"""Instruction sets: the kernels' path codes (the one table; csrc/include/isa.h mirrors
it), the CPU features the run-time probe finds, and which path of which kernel runs.

A feature is usable only where the CPU has it (CPUID) and the OS has enabled its
register state (XCR0: SSE+AVX state for AVX/AVX2/FMA/F16C, opmask+ZMM state for
AVX-512, tile state plus the process's arch_prctl permission for AMX). The probe is
csrc/cpu/features.c, built alone first without instruction-set flags
(`build.load_probe`); the kernels are then compiled for the usable set only
(`build.compile_flags`). `build.probe_features` runs the probe; `dispatch` chooses paths.
"""
from __future__ import annotations

from dataclasses import dataclass

# The paths a kernel takes, narrowest first (enum KvIsa).
ISAS = ("portable", "avx2", "avx512")
ISA_CODES = {name: code for code, name in enumerate(ISAS)}
# The kernels that have paths (enum KvKernel).
KERNELS = {"attention": 0, "quant": 1, "quant_gemm": 2, "bf16": 3, "f32_gemm": 4, "mask": 5, "mamba2": 6,
           "gated_delta": 7}
# Feature bits (enum KvFeature).
FEATURES = {"avx": 1 << 0, "avx2": 1 << 1, "fma": 1 << 2, "f16c": 1 << 3, "avx512f": 1 << 4, "avx512bw": 1 << 5,
            "avx512vl": 1 << 6, "avx512vnni": 1 << 7, "avx512bf16": 1 << 8, "amx_tile": 1 << 9, "amx_int8": 1 << 10,
            "amx_bf16": 1 << 11, "avx512dq": 1 << 12, "avx512fp16": 1 << 13, "apx": 1 << 14}
AMX = FEATURES["amx_tile"] | FEATURES["amx_int8"] | FEATURES["amx_bf16"]


def feature_names(mask: int) -> list[str]:
    """The names of the feature bits set in `mask`, in FEATURES' order."""
    return [name for name, bit in FEATURES.items() if mask & bit]


@dataclass(frozen=True)
class CpuFeatures:
    """What the probe found: the CPUID features, the XCR0 it read (after any test
    mask), whether Linux granted the AMX tile state, and the features this process
    may use (`usable`: CPUID and OS-enabled)."""

    cpuid: int
    xcr0: int
    amx_permitted: bool
    usable: int

    @property
    def amx(self) -> bool:
        """AMX tiles for int8 and bfloat16 are usable (CPUID, XCR0 and permission)."""
        return self.usable & AMX == AMX

    def has(self, *names: str) -> bool:
        return all(self.usable & FEATURES[name] for name in names)

    def describe(self) -> dict[str, list[str]]:
        """Feature names: found by CPUID, enabled by the OS, and found but not enabled."""
        return {"cpuid": feature_names(self.cpuid), "usable": feature_names(self.usable),
                "disabled_by_os": feature_names(self.cpuid & ~self.usable)}


def decide(lib, cpuid: int, xcr0: int, amx_permitted: bool) -> CpuFeatures:
    """The probe's decision (csrc/cpu/features.c kvserve_os_enabled_features) for these inputs."""
    usable = int(lib.kvserve_os_enabled_features(cpuid, xcr0, int(amx_permitted)))
    return CpuFeatures(cpuid=cpuid, xcr0=xcr0, amx_permitted=amx_permitted, usable=usable)
