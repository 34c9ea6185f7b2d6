"""`kvserve bench spec`'s summary (kvserve/bench/spec.py): per-round ratios and medians,
greedy identity per chat, the A/A control next to the speed-up, the rotating engine order."""
from __future__ import annotations

from kvserve.bench import spec
from kvserve.spec_decode.config import SpeculativeConfig


def _run(tokens_per_s: float, tokens: list[int], drafts: int = 0, accepted: int = 0) -> dict:
    return {"tokens": {"chat": tokens}, "num_tokens": len(tokens), "elapsed_s": len(tokens) / tokens_per_s,
            "tokens_per_s": tokens_per_s, "num_drafts": drafts, "num_draft_tokens": 4 * drafts,
            "num_accepted_tokens": accepted}


def test_summary_reports_speedup_identity_and_the_control():
    rounds = [{"grounded": {"off": _run(10.0, [1, 2, 3]), "on": _run(15.0, [1, 2, 3], 2, 6),
                            "control": _run(10.5, [1, 2, 3])}},
              {"grounded": {"off": _run(10.0, [1, 2, 3]), "on": _run(12.0, [1, 2, 4], 1, 2),
                            "control": _run(9.0, [1, 2, 3])}},
              {"grounded": {"off": _run(8.0, [1, 2, 3]), "on": _run(16.0, [1, 2, 3], 2, 8),
                            "control": _run(8.0, [1, 2, 3])}}]
    result = spec._summarize(rounds, ("grounded",), SpeculativeConfig.from_value(spec.DEFAULT_SPECULATIVE_CONFIG),
                             {}, 3)
    row = result["scenarios"][0]
    assert row["per_round_ratio"] == [1.5, 1.2, 2.0] and row["median_ratio"] == 1.5
    assert row["control_per_round_ratio"] == [1.05, 0.9, 1.0] and row["control_median_ratio"] == 1.0
    assert not row["greedy_outputs_identical"] and row["mismatched_chats"] == ["chat"]
    assert row["control_outputs_identical"]
    assert row["acceptance_rate"] == 16 / 20 and row["mean_accepted_length"] == 1 + 16 / 5
    table = spec.format_result(result)
    assert "A/A off/off" in table and "1.000x" in table and "1.500x" in table and "NO" in table


def test_summary_without_a_control_has_no_control_column():
    rounds = [{"unrelated": {"off": _run(10.0, [1]), "on": _run(9.5, [1])}}]
    result = spec._summarize(rounds, ("unrelated",), SpeculativeConfig.from_value(spec.DEFAULT_SPECULATIVE_CONFIG),
                             {}, 1)
    assert "control_median_ratio" not in result["scenarios"][0]
    assert "A/A" not in spec.format_result(result)


def test_engine_order_rotates_so_none_always_runs_first():
    names = ["off", "on", "control"]
    assert [spec.engine_order(r, names) for r in range(3)] == [
        ["off", "on", "control"], ["on", "control", "off"], ["control", "off", "on"]]
    assert [spec.engine_order(r, ["off", "on"])[0] for r in range(4)] == ["off", "on", "off", "on"]
