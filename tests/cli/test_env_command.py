"""`kvserve env`: the CPU features (CPUID and OS-enabled), the kernel paths, compiler,
torch and kernel cache, as text and as JSON."""
from __future__ import annotations

import json

from kvserve.cli import main
from kvserve.native import build, dispatch


def test_env_json_reports_features_paths_and_versions(capsys, monkeypatch):
    monkeypatch.setenv("KVSERVE_QUANT_ISA", "portable")
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"kvserve", "python", "torch", "cpu", "compiler", "kernel_cache", "kernel_paths", "cpu_features"} <= set(report)
    assert report["torch"].startswith("2.")
    assert report["switches"]["KVSERVE_QUANT_ISA"] == "portable"
    features = build.probe_features()
    if features is not None:
        assert report["cpu_features"] == features.describe()
        assert set(report["cpu_features"]["usable"]) <= set(report["cpu_features"]["cpuid"])
        assert report["amx"]["usable"] == features.amx
    if build.load_library() is not None:
        assert report["kernel_library"].startswith(report["kernel_cache"])
        assert "-march=native" in report["compile_flags"]
        # KVSERVE_QUANT_ISA caps every kernel the model picks a path for; the mask has its own cap
        assert {path for kernel, path in report["kernel_paths"].items() if kernel != "mask"} == {"portable"}
        assert report["kernel_paths"]["mask"] == dispatch.widest("mask")


def test_env_text_names_every_section(capsys, monkeypatch):
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for section in ("cpu_features:", "kernel_paths:", "compiler:", "torch:", "kernel_cache:"):
        assert section in out
    assert "  quant: None" in out  # the kernels are switched off: no path
