"""`kvserve bench structured`: the engine part's mask figures and their report lines."""
from __future__ import annotations

import pytest

from kvserve.bench.structured import _mask_figures, format_result
from kvserve.sample.logits_constraints import MaskStats


def test_mask_figures_are_per_constrained_token_and_the_hidden_share():
    before = MaskStats(steps=2, rows=10, head_rows=4, fill_s=0.001, start_s=0.00005, wait_s=0.0001, apply_s=0.0002,
                       advance_s=0.0001)
    after = MaskStats(steps=6, rows=50, head_rows=34, fill_s=0.003, start_s=0.00025, wait_s=0.0003, apply_s=0.0006,
                      advance_s=0.0003)
    figures = _mask_figures(before, after)
    assert figures["tokens"] == 40
    assert figures["fill_us_per_token"] == pytest.approx(50.0)
    assert figures["start_us_per_token"] == pytest.approx(5.0)
    assert figures["wait_us_per_token"] == pytest.approx(5.0)
    assert figures["apply_us_per_token"] == pytest.approx(10.0)
    assert figures["advance_us_per_token"] == pytest.approx(5.0)
    assert figures["critical_path_us_per_token"] == pytest.approx(25.0)
    assert figures["masked_in_lm_head_fraction"] == pytest.approx(0.75)
    assert figures["hidden_fraction_of_fill"] == pytest.approx(0.9)
    assert _mask_figures(after, after) is None and _mask_figures(None, after) is None


def test_report_has_both_batches_and_their_mask_cost():
    engine = {"output_tokens_per_s": {"unconstrained": 30.0, "json_schema": 29.0},
              "ratio_constrained_over_unconstrained_median": 0.97,
              "mask_in_engine": {"fill_us_per_token": 12.0, "hidden_fraction_of_fill": 0.95,
                                 "start_us_per_token": 1.0, "wait_us_per_token": 0.6, "apply_us_per_token": 3.0,
                                 "advance_us_per_token": 2.0, "critical_path_us_per_token": 6.6,
                                 "masked_in_lm_head_fraction": 0.9}}
    text = format_result({"backends": [], "engine_single": dict(engine, batch=1, mask_path="avx512"),
                          "engine": dict(engine, batch=32, mask_path="torch")})
    assert "engine, batch 1:" in text and "engine, batch 32:" in text
    assert text.count("fill 12.0 us on the mask thread (95% hidden behind the forward)") == 2
    assert ("start 1.0 + wait 0.6 + apply 3.0 + advance 2.0 = 6.6 us (90% of rows masked in the LM head; "
            "kernel path: avx512)") in text
    assert "kernel path: torch)" in text
