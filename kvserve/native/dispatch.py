"""Which path of which kernel runs here: built into the library, and every feature it
needs usable (csrc/cpu/features.c kvserve_isa_available, or a decision on given
features, as the tests use to simulate another CPU or OS)."""
from __future__ import annotations

from kvserve.native.build import load_library
from kvserve.native.isa import ISA_CODES, ISAS, KERNELS, CpuFeatures


def available(kernel: str, isa: str, features: CpuFeatures | None = None) -> bool:
    """Whether path `isa` of `kernel` runs here: this build has it and every feature it
    needs is usable (`features`: decide with these instead of the library's own probe)."""
    lib = load_library()
    if lib is None:
        return False
    if features is None:
        return bool(lib.kvserve_isa_available(KERNELS[kernel], ISA_CODES[isa]))
    needs = int(lib.kvserve_isa_requirement(KERNELS[kernel], ISA_CODES[isa]))
    return needs >= 0 and needs & features.usable == needs


def widest(kernel: str, ceiling: str | None = None, features: CpuFeatures | None = None) -> str | None:
    """The widest path of `kernel` that runs here, at most `ceiling`; None without the library."""
    if load_library() is None:
        return None
    top = ISA_CODES[ceiling] if ceiling else len(ISAS) - 1
    return next(isa for isa in reversed(ISAS[:top + 1]) if available(kernel, isa, features))
