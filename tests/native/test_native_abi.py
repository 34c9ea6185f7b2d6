"""The declared native interface: csrc/include/kvserve.h against abi.py's ctypes table,
the struct layout handshake, and every C file taking its declarations from the header."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from kvserve.native import abi, build

CSRC = Path(abi.__file__).parent / "csrc"
HEADER = CSRC / "include" / "kvserve.h"
# A top-level prototype: a return type at the start of a line, the name, the arguments, ";".
_PROTOTYPE = re.compile(r"^([A-Za-z_][\w \t\*]*?[ \t\*])(kvserve_\w+)\s*\(([^)]*)\)\s*;", re.M)

pytestmark = pytest.mark.skipif(build.load_library() is None, reason="no C compiler for the native kernels")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def _kind(c_type: str) -> tuple[str, int]:
    """A C type of the declared subset as (kind, bytes): pointers, fixed-size and plain
    integers, float, double, and void (a return type only)."""
    c_type = " ".join(c_type.replace("const", " ").split())
    if "*" in c_type:
        return ("pointer", ctypes.sizeof(ctypes.c_void_p))
    base = {"void": ("void", 0), "int": ("int", 4), "int32_t": ("int", 4), "int64_t": ("int", 8),
            "uint64_t": ("uint", 8), "float": ("float", 4), "double": ("float", 8)}
    if c_type not in base:
        raise AssertionError(f"kvserve.h uses {c_type!r}, which this parser does not know")
    return base[c_type]


def _ctypes_kind(t) -> tuple[str, int]:
    if t is None:
        return ("void", 0)
    if t is ctypes.c_void_p or issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr)):
        return ("pointer", ctypes.sizeof(ctypes.c_void_p))
    if t in (ctypes.c_float, ctypes.c_double):
        return ("float", ctypes.sizeof(t))
    signed = t(-1).value == -1
    return ("int" if signed else "uint", ctypes.sizeof(t))


def parse_header(text: str) -> dict[str, tuple[tuple[str, int], list[tuple[str, int]]]]:
    """export -> (return kind, argument kinds) for every prototype in `text`."""
    found = {}
    for ret, name, args in _PROTOTYPE.findall(_strip_comments(text)):
        params = [] if args.strip() in ("", "void") else [
            re.sub(r"\b\w+\s*$", "", p.strip()) if not p.strip().endswith("*") else p for p in args.split(",")]
        assert name not in found, f"{name} declared twice in kvserve.h"
        found[name] = (_kind(ret), [_kind(p) for p in params])
    return found


def test_the_parser_reads_what_it_is_given():
    parsed = parse_header("/* c */\nint64_t kvserve_a(const float *x, int64_t n,\n  uint64_t m, double d);\n"
                          "void kvserve_b(void);\nint32_t kvserve_c(void *ctx, int k);\n")
    assert parsed == {"kvserve_a": (("int", 8), [("pointer", 8), ("int", 8), ("uint", 8), ("float", 8)]),
                      "kvserve_b": (("void", 0), []), "kvserve_c": (("int", 4), [("pointer", 8), ("int", 4)])}


def test_every_ctypes_signature_matches_the_header():
    declared = parse_header(HEADER.read_text())
    problems = []
    for name, (argtypes, restype) in abi.SIGNATURES.items():
        if name not in declared:
            problems.append(f"{name}: not in kvserve.h")
            continue
        ret, args = declared[name]
        if _ctypes_kind(restype) != ret:
            problems.append(f"{name}: returns {ret} in C, {_ctypes_kind(restype)} in abi.py")
        if len(args) != len(argtypes):
            problems.append(f"{name}: {len(args)} arguments in C, {len(argtypes)} in abi.py")
        problems += [f"{name} argument {i}: {c} in C, {_ctypes_kind(t)} in abi.py"
                     for i, (c, t) in enumerate(zip(args, argtypes)) if c != _ctypes_kind(t)]
    assert not problems, "\n".join(problems)


def test_every_declared_export_is_in_the_library():
    lib = build.load_library()
    missing = [name for name in parse_header(HEADER.read_text()) if not hasattr(lib, name)]
    assert not missing


def test_every_c_file_includes_the_header_and_declares_no_other_files_function():
    for source in sorted(CSRC.glob("*/*.c")):
        text = _strip_comments(source.read_text())
        assert '#include "kvserve.h"' in text, source
        assert not _PROTOTYPE.findall(text), f"{source.name} declares {_PROTOTYPE.findall(text)[0][1]} itself"


def test_the_loaded_library_reports_the_mirrored_layout():
    abi.check_layout(build.load_library())  # raises on any difference
    assert len(abi.expected_layout()) > len(abi.LAYOUT_STRUCTS) * 5


class _ShiftedLayout:
    """A library whose one field sits elsewhere (as after a C-side edit abi.py missed)."""

    def __init__(self, shift_index: int, extra: int = 0) -> None:
        self.values = [value for _, value in abi.expected_layout()] + [0] * extra
        self.values[shift_index] += 8

    def kvserve_abi_layout(self, out, capacity):
        for i, value in enumerate(self.values[:capacity]):
            out[i] = value
        return len(self.values)


def test_a_moved_field_fails_loudly_naming_it():
    index = next(i for i, (what, _) in enumerate(abi.expected_layout()) if what == "offsetof(NativeStep, slots)")
    with pytest.raises(abi.AbiMismatchError, match=r"offsetof\(NativeStep, slots\)"):
        abi.check_layout(_ShiftedLayout(index))


def test_an_added_field_fails_loudly():
    with pytest.raises(abi.AbiMismatchError, match="layout entries"):
        abi.check_layout(_ShiftedLayout(0, extra=1))
