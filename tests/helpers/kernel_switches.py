"""The kernel switches a test runs with: the environment's (`KernelConfig.from_env`), so that
CI's reruns with KVSERVE_QUANT_ISA=avx2 and =portable (.ci/run) take the narrower paths in
the tests that load a model themselves, where `load_model` would otherwise allow every path."""
from __future__ import annotations

import dataclasses

from kvserve.native.config import KernelConfig


def env_kernels(**overrides) -> KernelConfig:
    """`KernelConfig.from_env()` with `overrides` (field=value) on top."""
    return dataclasses.replace(KernelConfig.from_env(), **overrides)
