"""Instruction sets: the kernels' path codes (the one table; csrc/include/isa.h mirrors
it), the CPU features the run-time probe finds, and which path of which kernel runs.

A feature is usable only where the CPU has it (CPUID) and the OS has enabled its
register state (XCR0: SSE+AVX state for AVX/AVX2/FMA/F16C, opmask+ZMM state for
AVX-512, tile state plus the process's arch_prctl permission for AMX). The probe is
csrc/cpu/features.c, built alone first without instruction-set flags
(`build.load_probe`); the kernels are then compiled for the usable set only
(`build.compile_flags`).

`KVSERVE_TEST_XCR0_MASK` (hex, a test hook) masks the XCR0 the probe reads, to
simulate an OS that enabled less than the CPU offers.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

# The paths a kernel takes, narrowest first (enum KvIsa).
ISAS = ("portable", "avx2", "avx512")
ISA_CODES = {name: code for code, name in enumerate(ISAS)}
# The kernels that have paths (enum KvKernel).
KERNELS = {"attention": 0, "quant": 1, "quant_gemm": 2, "bf16": 3, "f32_gemm": 4, "mask": 5}
# Feature bits (enum KvFeature).
FEATURES = {"avx": 1 << 0, "avx2": 1 << 1, "fma": 1 << 2, "f16c": 1 << 3, "avx512f": 1 << 4, "avx512bw": 1 << 5,
            "avx512vl": 1 << 6, "avx512vnni": 1 << 7, "avx512bf16": 1 << 8, "amx_tile": 1 << 9, "amx_int8": 1 << 10,
            "amx_bf16": 1 << 11, "avx512dq": 1 << 12, "avx512fp16": 1 << 13, "apx": 1 << 14}
AMX = FEATURES["amx_tile"] | FEATURES["amx_int8"] | FEATURES["amx_bf16"]
XCR0_MASK_ENV = "KVSERVE_TEST_XCR0_MASK"


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


def xcr0_mask_from_env(environ=None) -> int | None:
    """The test hook's mask (`KVSERVE_TEST_XCR0_MASK`, hex), or None."""
    raw = (os.environ if environ is None else environ).get(XCR0_MASK_ENV, "").strip()
    return int(raw, 16) if raw else None


def decide(lib, cpuid: int, xcr0: int, amx_permitted: bool) -> CpuFeatures:
    """The probe's decision (csrc/cpu/features.c kvserve_os_enabled_features) for these inputs."""
    usable = int(lib.kvserve_os_enabled_features(cpuid, xcr0, int(amx_permitted)))
    return CpuFeatures(cpuid=cpuid, xcr0=xcr0, amx_permitted=amx_permitted, usable=usable)


@functools.lru_cache(maxsize=None)
def _probe(xcr0_mask: int | None) -> CpuFeatures | None:
    from kvserve.native.build import load_probe
    lib = load_probe()
    if lib is None:
        return None
    cpuid, xcr0 = int(lib.kvserve_cpuid_features()), int(lib.kvserve_xcr0())
    if xcr0_mask is not None:
        xcr0 &= xcr0_mask
    state = (1 << 17) | (1 << 18)  # XTILECFG, XTILEDATA
    amx = bool(cpuid & AMX) and xcr0 & state == state and bool(lib.kvserve_request_amx_permission())
    return decide(lib, cpuid, xcr0, amx)


def probe() -> CpuFeatures | None:
    """This machine's features (None without a compiler or off x86), honouring the test mask."""
    return _probe(xcr0_mask_from_env())


def available(kernel: str, isa: str, features: CpuFeatures | None = None) -> bool:
    """Whether path `isa` of `kernel` runs here: this build has it and every feature it
    needs is usable (`features`: decide with these instead of the library's own probe)."""
    from kvserve.native.build import load_library
    lib = load_library()
    if lib is None:
        return False
    if features is None:
        return bool(lib.kvserve_isa_available(KERNELS[kernel], ISA_CODES[isa]))
    needs = int(lib.kvserve_isa_requirement(KERNELS[kernel], ISA_CODES[isa]))
    return needs >= 0 and needs & features.usable == needs


def widest(kernel: str, ceiling: str | None = None, features: CpuFeatures | None = None) -> str | None:
    """The widest path of `kernel` that runs here, at most `ceiling`; None without the library."""
    from kvserve.native.build import load_library
    if load_library() is None:
        return None
    top = ISA_CODES[ceiling] if ceiling else len(ISAS) - 1
    return next(isa for isa in reversed(ISAS[:top + 1]) if available(kernel, isa, features))
