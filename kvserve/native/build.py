"""Builds the native library at first use with the system C compiler and loads it with
ctypes (no torch headers, so a build takes seconds).

The sources are every .c and .h under csrc/ (grouped by job: attention, linear,
decoder, grammar, comm; csrc/include holds what they share). The shared object
is cached under `<cache root>/kernels/<key>/`, keyed by the sources, the
compiler flags, the compiler's version and the CPU's feature flags (code built
for this CPU must not run on another). Without a compiler `load_library()`
returns None and callers keep the portable torch path. Whether a model uses
the kernels at all is decided once per runner (`kvserve.model.kernels`, from
`KernelConfig`: KVSERVE_CPU_KERNELS=0 turns them off and nothing is built);
this module reads no switch.

The library is linked with `-fopenmp`: the library it needs (libgomp.so.1) is
the one torch already loaded, so both share one thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources

from kvserve.paths import cache_root
from kvserve.native import abi

logger = logging.getLogger(__name__)

_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_INCLUDE_DIR = "include"

_lock = threading.Lock()
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


def _build(cc: str, sources: dict[str, str], target_dir: str) -> str:
    target = os.path.join(target_dir, "kvserve_cpu.so")
    if os.path.exists(target):
        return target
    os.makedirs(target_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
        units = []
        for name, text in sources.items():
            path = os.path.join(tmp, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
            if name.endswith(".c"):
                units.append(path)
        tmp_target = os.path.join(tmp, "out.so")
        subprocess.run([cc, *_CFLAGS, f"-I{os.path.join(tmp, _INCLUDE_DIR)}", *units, "-o", tmp_target, "-lm"],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp_target, target)  # atomic: concurrent builders (TP ranks) agree
    return target


def _load() -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU attention and norms use the slower torch path")
        return None
    sources = _sources()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([*sources, *sources.values(), " ".join(_CFLAGS), version,
                                    _cpu_flags()]).encode())
    try:
        lib = ctypes.CDLL(_build(cc, sources, os.path.join(cache_root(), "kernels", key.hexdigest()[:16])))
        abi.declare(lib)
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("building the CPU kernels failed, using the torch path: %s", detail.strip()[-500:])
        return None
    return lib


def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, build failed); built once per process."""
    if "lib" in _loaded:  # the per-op fast path: no lock
        return _loaded["lib"]
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]
