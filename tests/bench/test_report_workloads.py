"""Statistics, tables and workloads checked against independent computations."""
from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from kvserve.bench.report import LatencyStats, format_table, percentile, write_json
from kvserve.bench.workloads import build_workload, mixed_workload, shared_prefix_workload, text_prompts


@pytest.mark.parametrize("size", [1, 2, 7, 100])
def test_percentiles_match_numpy(size):
    rng = random.Random(size)
    values = sorted(rng.uniform(0, 10) for _ in range(size))
    for pct in (0, 50, 90, 99, 100):
        assert percentile(values, pct) == pytest.approx(float(np.percentile(values, pct)))


def test_latency_stats_in_milliseconds_and_empty():
    stats = LatencyStats.from_seconds([0.5, 0.1, 0.3])
    assert stats.count == 3 and stats.p50_ms == pytest.approx(300) and stats.max_ms == pytest.approx(500)
    assert stats.mean_ms == pytest.approx(statistics.mean([100, 300, 500]))
    assert math.isnan(LatencyStats.from_seconds([]).p99_ms)


def test_table_aligns_columns():
    text = format_table(["name", "value"], [["a", 1234567], ["longer name", 0.5]], title="t")
    lines = text.splitlines()
    assert lines[0] == "t" and "1,234,567" in text and "0.50" in text
    assert len({len(line) for line in lines[1:]}) == 1  # header, rule and rows share one width


def test_json_turns_nan_into_null(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"x": math.nan, "y": [1.0, math.nan]})
    assert json.loads(path.read_text()) == {"x": None, "y": [1.0, None]}


def test_workloads_are_deterministic_and_sized():
    fixed = build_workload("fixed", vocab_size=1000, num_requests=5, prompt_len=7, output_len=3, seed=1)
    assert fixed == build_workload("fixed", vocab_size=1000, num_requests=5, prompt_len=7, output_len=3, seed=1)
    assert [r.prompt_len for r in fixed.requests] == [7] * 5 and fixed.num_output_tokens == 15
    assert len({tuple(r.prompt_token_ids) for r in fixed.requests}) == 5
    assert all(0 <= t < 1000 for r in fixed.requests for t in r.prompt_token_ids)
    assert build_workload("single", vocab_size=1000).summary()["num_requests"] == 1


def test_mixed_workload_spreads_lengths_within_bounds():
    mixed = mixed_workload(400, vocab_size=50_000, seed=0)
    prompt_lens = [r.prompt_len for r in mixed.requests]
    output_lens = [r.output_len for r in mixed.requests]
    assert min(prompt_lens) >= 16 and max(prompt_lens) <= 1024
    assert min(output_lens) >= 8 and max(output_lens) <= 512
    assert 180 < statistics.median(prompt_lens) < 340 and 60 < statistics.median(output_lens) < 130
    assert statistics.pstdev(output_lens) > 30  # variable lengths are the point of this workload
    clipped = build_workload("mixed", vocab_size=1000, num_requests=8, max_prompt_len=12, max_output_len=4)
    assert all(r.prompt_len <= 12 and r.output_len <= 4 for r in clipped.requests)


def test_shared_prefix_and_text_prompts():
    workload = shared_prefix_workload(4, prefix_len=50, question_len=5, output_len=2, vocab_size=1000)
    prefixes = {tuple(r.prompt_token_ids[:50]) for r in workload.requests}
    assert len(prefixes) == 1 and len({tuple(r.prompt_token_ids) for r in workload.requests}) == 4
    prompts = text_prompts(3, 10, seed=2)
    assert prompts == text_prompts(3, 10, seed=2) and all(len(p.split()) == 10 for p in prompts)
