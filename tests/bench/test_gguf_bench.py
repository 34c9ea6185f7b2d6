"""`kvserve bench gguf` in a tiny configuration, through the CLI."""
from __future__ import annotations

import pytest

from kvserve.native import cpu_kernels

from .test_cli import run_bench

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")


def test_gguf_bench_tiny(tmp_path, capsys):
    result = run_bench(tmp_path, capsys, "gguf", "--types", "q4_k,Q8_0,mxfp4", "--out-features", "8", "--in-features",
                       "256", "--batch-sizes", "1,3", "--threads", "1", "--isas", "portable", "--footprint-mb", "1",
                       "--repeats", "1", "--no-plot")
    rows = result["results"]
    assert [(r["type"], r["batch"]) for r in rows] == [("Q4_K", 1), ("Q4_K", 3), ("Q8_0", 1), ("Q8_0", 3),
                                                       ("MXFP4", 1), ("MXFP4", 3)]
    assert result["shape"] == [8, 256]
    for r in rows:
        assert r["isa"] == "portable" and r["threads"] == 1 and r["us_per_call"] > 0
        assert r["pct_of_bound"] == pytest.approx(100 * r["weight_gb_per_s"] / r["read_bandwidth_gb_per_s"], abs=0.2)


def test_gguf_bench_rejects_an_unknown_path_or_type(tmp_path, capsys):
    from kvserve.cli import main
    code = main(["bench", "gguf", "--isas", "neon", "--repeats", "1", "--no-plot", "--output-json",
                 str(tmp_path / "a.json")])
    assert code != 0 and "unknown kernel path(s) ['neon']" in capsys.readouterr().err
    code = main(["bench", "gguf", "--types", "F16", "--repeats", "1", "--no-plot", "--output-json",
                 str(tmp_path / "b.json")])
    assert code != 0 and "no benchmark weights for ['F16']" in capsys.readouterr().err
