"""Builds the native library at first use with the system C compiler and loads it with
ctypes (no torch headers, so a build takes seconds).

The sources are every .c and .h under csrc/ (grouped by job: attention, linear,
decoder, grammar, comm; cpu/ the run-time probe and the layout handshake; include/
what they share). The shared object is cached under `<cache root>/kernels/<key>/`,
keyed by the sources, the compiler flags, the compiler's version and the CPU. Without
a compiler `load_library()` returns None and callers keep the portable torch path.
Whether a model uses the kernels at all is decided once per runner
(`kvserve.model.kernels`, from `KernelConfig`: KVSERVE_CPU_KERNELS=0 turns them off
and nothing is built).

Instruction sets: the compiler may emit only what the run-time probe approved. The
probe (csrc/cpu/features.c) is built first on its own, without instruction-set flags,
and says which features this CPU has and the OS enabled (`isa.probe`). The kernels
are then built with `-march=native` minus every instruction set the probe did not
approve (`-mno-avx512f`, `-mno-amx-tile`, ...), and the build checks, from the
compiler's own predefined macros, that no unapproved set is left on; otherwise it
refuses. (`-march=native` alone reads CPUID, not what the OS enabled; a list of
explicit `-m` flags would miss the rest of what native enables, its tuning included,
and change the code the kernels compile to.) See docs/native.md.

At load the library's struct layout is compared with abi.py's (`abi.check_layout`):
a mismatch raises `AbiMismatchError` instead of corrupting memory.

The library is linked with `-fopenmp`: the library it needs (libgomp.so.1) is
the one torch already loaded, so both share one thread pool.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from importlib import resources

from kvserve.native import abi, isa
from kvserve.paths import cache_root

logger = logging.getLogger(__name__)

_CFLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_PROBE_CFLAGS = ["-O2", "-fPIC", "-shared", "-std=c11"]
_PROBE_SOURCE = "cpu/features.c"
_INCLUDE_DIR = "include"

_lock = threading.Lock()
_probe_lock = threading.Lock()  # taken inside _lock: the library build runs the probe first
_loaded: dict[str, object] = {}


def _sources() -> dict[str, str]:
    """Every C source and header under csrc/, by its path relative to csrc/."""
    found: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            name = f"{prefix}{child.name}"
            if child.is_dir():
                walk(child, f"{name}/")
            elif child.name.endswith((".c", ".h")):
                found[name] = child.read_text()
    walk(resources.files("kvserve.native").joinpath("csrc"), "")
    return found


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    """The C compiler the library is built with ($CC, else gcc or cc), or None."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


class BuildRefused(RuntimeError):
    """The compiler would enable an instruction set the run-time probe did not approve."""


def _build(cc: str, sources: dict[str, str], flags: list[str], target_dir: str, name: str) -> str:
    target = os.path.join(target_dir, name)
    if os.path.exists(target):
        return target
    os.makedirs(target_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        units = []
        for rel, text in sources.items():
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            if rel.endswith(".c"):
                units.append(path)
        tmp_target = os.path.join(tmp, "out.so")
        subprocess.run([cc, *flags, f"-I{os.path.join(tmp, _INCLUDE_DIR)}", *units, "-o", tmp_target, "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp_target, target)  # atomic: concurrent builders (TP ranks) agree
    return target


def _cache_dir(*parts: str) -> str:
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "kernels", key)


@functools.lru_cache(maxsize=None)
def _compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _predefined_isa_macros(cc: str, flags: list[str]) -> set[str]:
    """The instruction-set macros (__AVX2__, __AMX_TILE__, ...) the compiler defines under `flags`."""
    out = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define __") and len(line.split()) > 1}


_MACRO_FEATURE = {"__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
                  "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
                  "__AVX512VNNI__": "avx512vnni", "__AVX512BF16__": "avx512bf16", "__AVX512DQ__": "avx512dq",
                  "__AVX512FP16__": "avx512fp16", "__AMX_TILE__": "amx_tile", "__AMX_INT8__": "amx_int8",
                  "__AMX_BF16__": "amx_bf16", "__APX_F__": "apx"}


def _needed_feature(macro: str) -> str | None:
    """The probe's feature an instruction-set macro needs (its OS state), None for sets
    that need no OS-enabled state (SSE, BMI, POPCNT, ...: CPUID alone, as native read it)."""
    if macro in _MACRO_FEATURE:
        return _MACRO_FEATURE[macro]
    if macro.startswith(("__AVX512", "__AVX10")):
        return "avx512f"
    if macro.startswith("__AMX"):
        return "amx_tile"
    if macro.startswith("__AVX") or macro in ("__VAES__", "__VPCLMULQDQ__"):
        return "avx"
    return None


def unapproved(macros: set[str], features: isa.CpuFeatures) -> list[str]:
    """The instruction-set macros in `macros` whose feature the probe did not approve."""
    return sorted(m for m in macros if (need := _needed_feature(m)) is not None
                  and not (features.has(need) and (not need.startswith("amx") or features.amx)))


def _disable_flag(macro: str) -> str:
    name = macro.strip("_").lower().replace("_", "-")
    return "-mno-" + {"apx-f": "apxf"}.get(name, name)


def compile_flags(cc: str, features: isa.CpuFeatures | None) -> list[str]:
    """`-march=native` minus every instruction set `features` does not approve; raises
    `BuildRefused` where the compiler still enables one."""
    flags = ["-march=native"]
    if features is None or not _is_x86():
        return flags
    if not features.has("avx"):
        flags.append("-mno-avx")  # and everything built on it: AVX2, FMA, F16C, AVX-512
    elif not features.has("avx512f"):
        flags.append("-mno-avx512f")  # and every AVX-512 subset
    for _ in range(3):
        left = unapproved(_predefined_isa_macros(cc, flags), features)
        if not left:
            return flags
        flags += [_disable_flag(m) for m in left if _disable_flag(m) not in flags]
    raise BuildRefused(f"{cc} still enables {', '.join(left)} with {' '.join(flags)}, which this CPU or OS "
                       f"does not support")


def _declare_probe(lib: ctypes.CDLL) -> None:
    for name in abi.PROBE_EXPORTS:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = abi.SIGNATURES[name]


def _probe_sources() -> dict[str, str]:
    return {name: text for name, text in _sources().items() if name == _PROBE_SOURCE or name.endswith(".h")}


def load_probe() -> ctypes.CDLL | None:
    """The run-time probe alone (csrc/cpu/features.c built without instruction-set flags), or None."""
    if "probe" in _loaded:
        return _loaded["probe"]
    with _probe_lock:
        if "probe" not in _loaded:
            _loaded["probe"] = _load_probe()
        return _loaded["probe"]


def _load_probe() -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        return None
    sources = _probe_sources()
    try:
        path = _build(cc, sources, _PROBE_CFLAGS, _cache_dir(*sources, *sources.values(), *_PROBE_CFLAGS,
                                                             _compiler_version(cc)), "kvserve_probe.so")
        lib = ctypes.CDLL(path)
        _declare_probe(lib)
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("building the CPU feature probe failed: %s", detail.strip()[-500:])
        return None
    return lib


# A test hook: a hex mask applied to the XCR0 the probe reads, to simulate an OS that
# enabled less than the CPU offers (the library is then built as it would be there).
XCR0_MASK_ENV = "KVSERVE_TEST_XCR0_MASK"
_AMX_STATE = (1 << 17) | (1 << 18)  # XCR0's XTILECFG and XTILEDATA


def xcr0_mask_from_env(environ=None) -> int | None:
    """The test hook's mask (`KVSERVE_TEST_XCR0_MASK`, hex), or None."""
    raw = (os.environ if environ is None else environ).get(XCR0_MASK_ENV, "").strip()
    return int(raw, 16) if raw else None


@functools.lru_cache(maxsize=None)
def _probe(xcr0_mask: int | None) -> isa.CpuFeatures | None:
    lib = load_probe()
    if lib is None:
        return None
    cpuid, xcr0 = int(lib.kvserve_cpuid_features()), int(lib.kvserve_xcr0())
    if xcr0_mask is not None:
        xcr0 &= xcr0_mask
    amx = bool(cpuid & isa.AMX) and xcr0 & _AMX_STATE == _AMX_STATE and bool(lib.kvserve_request_amx_permission())
    return isa.decide(lib, cpuid, xcr0, amx)


def probe_features() -> isa.CpuFeatures | None:
    """This machine's features (None without a compiler), honouring the test mask."""
    return _probe(xcr0_mask_from_env())


@dataclass(frozen=True)
class BuildInfo:
    """How the loaded library was built: compiler, flags, path, and the probe's features."""

    compiler: str
    compiler_version: str
    flags: tuple[str, ...]
    path: str
    features: isa.CpuFeatures | None


def _load() -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU attention and norms use the slower torch path")
        return None
    sources = _sources()
    try:
        version = _compiler_version(cc)
        features = probe_features()
        flags = [*_CFLAGS, *compile_flags(cc, features)]
        target_dir = _cache_dir(*sources, *sources.values(), " ".join(flags), version, _cpu_flags(),
                                str(features and features.usable))
        path = _build(cc, sources, flags, target_dir, "kvserve_cpu.so")
        lib = ctypes.CDLL(path)
        abi.declare(lib)
    except (OSError, AttributeError, subprocess.SubprocessError, BuildRefused) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("building the CPU kernels failed, using the torch path: %s", detail.strip()[-500:])
        return None
    abi.check_layout(lib)  # a mismatch is a bug in this package: loud, never a fallback
    info = BuildInfo(cc, version.splitlines()[0] if version else "", tuple(flags), path, features)
    _loaded["info"] = info
    _log_build(info)
    return lib


def _log_build(info: BuildInfo) -> None:
    """Once per process, at INFO: the library, the flags beyond the fixed ones, the features."""
    features = info.features
    refused = features.cpuid & ~features.usable if features else 0
    logger.info("native kernels: %s built with %s; CPU features %s%s", info.path,
                " ".join(info.flags[len(_CFLAGS):]),
                " ".join(isa.feature_names(features.usable)) if features else "unknown",
                f" (CPUID also has, not enabled by the OS: {' '.join(isa.feature_names(refused))})" if refused else "")


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, build failed); built once per process."""
    if "lib" in _loaded:  # the per-op fast path: no lock
        return _loaded["lib"]
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def build_info() -> BuildInfo | None:
    """How the library was built (None where it is not loaded)."""
    return _loaded.get("info") if load_library() is not None else None
