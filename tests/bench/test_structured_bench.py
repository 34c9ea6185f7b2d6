"""`kvserve bench structured`: the engine part's mask figures and their report lines."""
from __future__ import annotations

import pytest

from kvserve.bench.structured import _mask_figures, format_result
from kvserve.worker.logits_constraints import MaskStats


def test_mask_figures_are_per_constrained_token_and_the_hidden_share():
    before = MaskStats(steps=2, rows=10, fill_s=0.001, wait_s=0.0001, apply_s=0.0002)
    after = MaskStats(steps=6, rows=50, fill_s=0.003, wait_s=0.0003, apply_s=0.0006)
    figures = _mask_figures(before, after)
    assert figures["tokens"] == 40
    assert figures["fill_us_per_token"] == pytest.approx(50.0)
    assert figures["wait_us_per_token"] == pytest.approx(5.0)
    assert figures["apply_us_per_token"] == pytest.approx(10.0)
    assert figures["critical_path_us_per_token"] == pytest.approx(15.0)
    assert figures["hidden_fraction_of_fill"] == pytest.approx(0.9)
    assert _mask_figures(after, after) is None and _mask_figures(None, after) is None


def test_report_has_both_batches_and_their_mask_cost():
    engine = {"output_tokens_per_s": {"unconstrained": 30.0, "json_schema": 29.0},
              "ratio_constrained_over_unconstrained_median": 0.97,
              "mask_in_engine": {"fill_us_per_token": 12.0, "hidden_fraction_of_fill": 0.95,
                                 "wait_us_per_token": 0.6, "apply_us_per_token": 3.0}}
    text = format_result({"backends": [], "engine_single": dict(engine, batch=1, mask_path="avx512"),
                          "engine": dict(engine, batch=32, mask_path="torch")})
    assert "engine, batch 1:" in text and "engine, batch 32:" in text
    assert text.count("fill 12.0 us on the mask thread (95% hidden behind the forward)") == 2
    assert "wait 0.6 us + apply 3.0 us = 3.6 us (apply path: avx512)" in text and "(apply path: torch)" in text
