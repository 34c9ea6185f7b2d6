"""Every KVSERVE_* environment variable the package reads has its row in the one table of
docs/kernels.md, and the kernel switches are read in one place only (`KernelConfig.from_env`)."""
from __future__ import annotations

import pathlib
import re

import kvserve
from kvserve.config import EngineConfig
from kvserve.native.config import (CPU_KERNELS_ENV, CPU_PACKED_WEIGHTS_ENV, GRAMMAR_MASK_ISA_ENV, QUANT_ACT_BITS_ENV,
                                   QUANT_GEMM_DTYPE_ENV, QUANT_GEMM_ROWS_ENV, QUANT_ISA_ENV, SHM_ALL_REDUCE_ENV,
                                   SMALL_BATCH_MATMUL_ENV, KernelConfig)

PACKAGE = pathlib.Path(kvserve.__file__).parent
ENVIRONMENT_TABLE = PACKAGE.parent / "docs" / "kernels.md"
KERNEL_SWITCHES = (CPU_KERNELS_ENV, SMALL_BATCH_MATMUL_ENV, CPU_PACKED_WEIGHTS_ENV, QUANT_ISA_ENV, QUANT_ACT_BITS_ENV,
                   QUANT_GEMM_ROWS_ENV, QUANT_GEMM_DTYPE_ENV, GRAMMAR_MASK_ISA_ENV, SHM_ALL_REDUCE_ENV)


def _python_sources() -> dict[pathlib.Path, str]:
    return {path: path.read_text() for path in PACKAGE.rglob("*.py")}


def _table_rows() -> set[str]:
    """The variables of docs/kernels.md's table: the first cell of each row."""
    return set(re.findall(r"^\| `(KVSERVE_[A-Z0-9_]+)` \|", ENVIRONMENT_TABLE.read_text(), flags=re.M))


def test_every_environment_variable_has_its_row_in_the_table():
    names = {name for text in _python_sources().values() for name in re.findall(r"KVSERVE_[A-Z0-9_]+", text)}
    assert set(KERNEL_SWITCHES) <= names  # the scan sees what it should
    rows = _table_rows()
    assert not sorted(names - rows), f"no row in docs/kernels.md's table: {sorted(names - rows)}"
    assert not sorted(rows - names), f"rows for variables nothing reads: {sorted(rows - names)}"


def test_kernel_switches_are_read_only_by_kernel_config():
    """Only native/config.py names them as string literals (docstrings elsewhere may mention them)."""
    readers = sorted(str(path.relative_to(PACKAGE)) for path, text in _python_sources().items()
                     if any(f'"{name}"' in text or f"'{name}'" in text for name in KERNEL_SWITCHES))
    assert readers == ["native/config.py"]


def test_kernel_config_from_the_environment(monkeypatch):
    assert KernelConfig.from_env({}) == KernelConfig()
    monkeypatch.setenv(CPU_PACKED_WEIGHTS_ENV, "0")
    monkeypatch.setenv(QUANT_ACT_BITS_ENV, "8")
    monkeypatch.setenv(QUANT_ISA_ENV, "AVX2")
    monkeypatch.setenv(SHM_ALL_REDUCE_ENV, "off")
    expected = KernelConfig(packed_weights=False, quant_act_bits=8, quant_isa="avx2", shm_all_reduce=False)
    assert KernelConfig.from_env() == expected
    assert EngineConfig.__dataclass_fields__["kernel_config"].default_factory() == expected
