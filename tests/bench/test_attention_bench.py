"""`kvserve bench attention` in a tiny configuration, through the CLI."""
from __future__ import annotations

import pytest

from kvserve.native import cpu_kernels

from .test_cli import run_bench

pytestmark = pytest.mark.skipif(cpu_kernels.load_library() is None, reason="no native kernels")


def test_attention_bench_tiny(tmp_path, capsys):
    result = run_bench(tmp_path, capsys, "attention", "--batch-sizes", "1,3", "--context-lens", "17",
                       "--kv-dtypes", "float32,float16", "--isas", "portable", "--layers", "2", "--repeats", "2",
                       "--threads", "1", "--no-plot")
    rows = result["results"]
    assert [(r["batch"], r["kv_dtype"]) for r in rows] == [(1, "float32"), (1, "float16"), (3, "float32"),
                                                           (3, "float16")]
    assert result["shape"] == {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "block_size": 16, "layers": 2}
    for r in rows:
        assert r["isa"] == "portable" and r["us_per_layer"] > 0
        # FLOPs per K/V byte: 4 * query heads * D per key over 2 * KV heads * D * element bytes.
        element_bytes = 4 if r["kv_dtype"] == "float32" else 2
        assert r["gflop_per_s"] / r["kv_gb_per_s"] == pytest.approx(4 * 9 / (2 * 3 * element_bytes), rel=0.02)


def test_attention_bench_rejects_an_unknown_path(tmp_path, capsys):
    from kvserve.cli import main
    code = main(["bench", "attention", "--isas", "neon", "--layers", "1", "--repeats", "1", "--no-plot",
                 "--output-json", str(tmp_path / "a.json")])
    assert code != 0 and "unknown kernel path(s) ['neon']" in capsys.readouterr().err
