"""/metrics exposes speculative decoding under vLLM's names; the engine loop accumulates them."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_llm import EngineLoopStats
from kvserve.scheduler.speculation import SpecDecodingStats
from kvserve.server.metrics import ServerMetrics


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k == "position"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_spec_decode_counters_use_vllm_names():
    spec = SpecDecodingStats()
    spec.add(SpecDecodingStats(2, 7, 4, [2, 1, 1]))
    spec.observe(num_draft_tokens=4, num_accepted_tokens=2)
    samples = _samples(ServerMetrics(lambda: EngineLoopStats(spec_decoding=spec), "m"))
    assert samples[("vllm:spec_decode_num_drafts_total", ())] == 3
    assert samples[("vllm:spec_decode_num_draft_tokens_total", ())] == 11
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", ())] == 6
    per_pos = {labels: value for (name, labels), value in samples.items()
               if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {(("position", "0"),): 3, (("position", "1"),): 2, (("position", "2"),): 1,
                       (("position", "3"),): 0}


def test_no_spec_decode_metrics_without_speculation():
    samples = _samples(ServerMetrics(lambda: EngineLoopStats(), "m"))
    assert not any(name.startswith("vllm:spec_decode") for name, _ in samples)
