"""The run-time probe: features the OS did not enable are not used, the compiler is
never allowed an instruction set the probe did not approve, and each path this
machine runs can be forced."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvserve.native import build, dispatch, isa
from kvserve.native.config import QUANT_ISA_ENV, KernelConfig

pytestmark = pytest.mark.skipif(build.load_probe() is None or not build._is_x86(),
                                reason="no C compiler, or not an x86 CPU")

ALL_FEATURES = sum(isa.FEATURES.values())
SSE_AVX = (1 << 1) | (1 << 2)
AVX512_STATE = (1 << 5) | (1 << 6) | (1 << 7)
AMX_STATE = (1 << 17) | (1 << 18)
FULL_XCR0 = SSE_AVX | AVX512_STATE | AMX_STATE | (1 << 19)
AVX512_NAMES = {name for name in isa.FEATURES if name.startswith("avx512")}
AMX_NAMES = {"amx_tile", "amx_int8", "amx_bf16"}


def _decide(xcr0: int, amx_permitted: bool = True, cpuid: int = ALL_FEATURES) -> isa.CpuFeatures:
    return isa.decide(build.load_probe(), cpuid, xcr0, amx_permitted)


def test_a_cpu_with_everything_and_an_os_that_enables_everything():
    features = _decide(FULL_XCR0)
    assert features.usable == ALL_FEATURES and features.amx


def test_cpuid_says_avx512_but_the_os_saves_no_zmm_state():
    names = set(isa.feature_names(_decide(FULL_XCR0 & ~AVX512_STATE).usable))
    assert not names & AVX512_NAMES and {"avx", "avx2", "fma", "f16c"} <= names and AMX_NAMES <= names
    for missing_bit in (5, 6, 7):  # any one of opmask, ZMM_Hi256, Hi16_ZMM missing is enough
        assert not set(isa.feature_names(_decide(FULL_XCR0 & ~(1 << missing_bit)).usable)) & AVX512_NAMES


def test_no_avx_state_means_no_avx_of_any_width():
    names = set(isa.feature_names(_decide(FULL_XCR0 & ~(1 << 2)).usable))
    assert not names & ({"avx", "avx2", "fma", "f16c"} | AVX512_NAMES)


def test_amx_needs_both_tile_states_and_the_permission():
    assert not _decide(FULL_XCR0, amx_permitted=False).amx
    assert not _decide(FULL_XCR0 & ~(1 << 18), amx_permitted=True).amx
    assert not _decide(FULL_XCR0 & ~(1 << 17), amx_permitted=True).amx
    assert not _decide(FULL_XCR0, cpuid=ALL_FEATURES & ~isa.FEATURES["amx_int8"]).amx


def test_the_os_never_adds_what_cpuid_lacks():
    assert _decide(FULL_XCR0, cpuid=isa.FEATURES["avx"] | isa.FEATURES["avx2"]).usable == \
        isa.FEATURES["avx"] | isa.FEATURES["avx2"]


def test_this_machines_probe_is_consistent():
    features = build.probe_features()
    assert features.usable & ~features.cpuid == 0
    if features.has("avx512f"):
        assert features.xcr0 & (SSE_AVX | AVX512_STATE) == SSE_AVX | AVX512_STATE
    if features.amx:
        assert features.amx_permitted and features.xcr0 & AMX_STATE == AMX_STATE


@pytest.mark.skipif(build.load_library() is None, reason="no native kernels")
@pytest.mark.parametrize("kernel", sorted(isa.KERNELS))
def test_os_disabled_avx512_state_chooses_the_narrower_path(kernel):
    """The probe's decision with this CPU's CPUID but an XCR0 without AVX-512 state (and
    then without AVX state) picks AVX2 (then portable) wherever the wider path exists."""
    real = build.probe_features()
    no_zmm = isa.decide(build.load_probe(), real.cpuid, real.xcr0 & ~AVX512_STATE, real.amx_permitted)
    no_ymm = isa.decide(build.load_probe(), real.cpuid, real.xcr0 & ~(1 << 2), real.amx_permitted)
    assert dispatch.widest(kernel, features=no_zmm) == ("avx2" if dispatch.available(kernel, "avx2") else "portable")
    assert dispatch.widest(kernel, features=no_ymm) == "portable"
    assert not dispatch.available(kernel, "avx512", features=no_zmm)


@pytest.mark.parametrize("xcr0_mask", [~AVX512_STATE, ~(1 << 2), ~AMX_STATE])
def test_the_compiler_is_never_allowed_what_the_probe_refused(xcr0_mask):
    """-march=native minus the refused sets: the compiler's own predefined macros show no
    instruction set the masked probe did not approve."""
    real = build.probe_features()
    masked = isa.decide(build.load_probe(), real.cpuid, real.xcr0 & xcr0_mask, False)
    cc = build.compiler()
    flags = build.compile_flags(cc, masked)
    macros = build._predefined_isa_macros(cc, flags)
    assert build.unapproved(macros, masked) == []
    if not masked.has("avx512f"):
        assert "__AVX512F__" not in macros and not any(m.startswith("__AVX512") for m in macros)
    if not masked.has("avx"):
        assert not {"__AVX__", "__AVX2__", "__FMA__"} & macros
    assert not any(m.startswith("__AMX") for m in macros)


def test_the_unmasked_build_is_plain_native_where_the_os_enabled_everything_native_uses():
    """Where nothing is refused the flags are -march=native alone (the code as before)."""
    cc = build.compiler()
    features = build.probe_features()
    native = build._predefined_isa_macros(cc, ["-march=native"])
    if not build.unapproved(native, features):
        assert build.compile_flags(cc, features) == ["-march=native"]


@pytest.mark.skipif(build.load_library() is None, reason="no native kernels")
@pytest.mark.parametrize("ceiling", isa.ISAS)
def test_each_runnable_path_can_be_forced(ceiling):
    """KVSERVE_QUANT_ISA caps every kernel the model picks a path for; the path forced is
    the one taken where the kernel has it on this machine."""
    from kvserve.model import native_decoder, quantized
    if not dispatch.available("quant", ceiling):
        pytest.skip(f"this machine does not run the {ceiling} path")
    config = KernelConfig.from_env({QUANT_ISA_ENV: ceiling})
    assert quantized.kernel_isa(config) == ceiling
    for kernel, chosen in (("bf16", native_decoder.bf16_isa(config)), ("f32_gemm", native_decoder.f32_gemm_isa(config)),
                           ("attention", native_decoder.attention_isa(config))):
        assert chosen == dispatch.widest(kernel, ceiling)
        assert isa.ISA_CODES[chosen] <= isa.ISA_CODES[ceiling]


_CHILD = """
import json, torch
from kvserve.native import build, cpu_kernels, dispatch, isa
from kvserve.model import quantized
lib = build.load_library()
info = build.build_info()
x = torch.randn(3, 64)
w = torch.randn(64)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
out = cpu_kernels.rms_norm(x, w, 1e-6, False)
print(json.dumps({"flags": list(info.flags), "usable": isa.feature_names(info.features.usable),
                  "paths": {k: dispatch.widest(k) for k in isa.KERNELS}, "quant": quantized.kernel_isa(),
                  "norm_error": float((out - ref).abs().max())}))
"""


@pytest.mark.slow
def test_a_library_built_where_the_os_disabled_avx512_runs_the_avx2_paths(tmp_path):
    """End to end: with the test hook masking XCR0's AVX-512 state, the library is built
    without AVX-512 (-mno-avx512f) and every kernel takes its AVX2 path."""
    env = {**os.environ, build.XCR0_MASK_ENV: hex(0xFFFFFFFF & ~AVX512_STATE), "KVSERVE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "-mno-avx512f" in report["flags"] and not AVX512_NAMES & set(report["usable"])
    expected = "avx2" if "avx2" in report["usable"] else "portable"
    assert report["quant"] == expected and set(report["paths"].values()) == {expected}
    assert report["norm_error"] < 1e-4  # float32 RMSNorm of 64 N(0,1) values: a few ulps of values below ~4
