"""Speculative decoding through `LLM` with the default model (quantized, as shipped): greedy
outputs equal the engine without it (stop strings, n > 1 included; the bench's input-grounded
chats, whose verify steps of 5 tokens would take the panel GEMM where plain decoding takes the
row kernel, see `quantized.linear`'s `num_draft_rows`), and each completion reports its drafts."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.bench.spec import DEFAULT_SPECULATIVE_CONFIG
from kvserve.bench.spec_chats import GROUNDED_CHATS, as_conversation

CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
CHATS = [
    [{"role": "user", "content": f"Copy this code exactly:\n\n{CODE}"}],
    [{"role": "user", "content": "Name three colours."}],
]


@pytest.fixture(scope="module")
def engines():
    kwargs = dict(max_model_len=1024, kv_cache_memory="128MiB")
    plain = LLM(**kwargs)
    spec = LLM(speculative_config=DEFAULT_SPECULATIVE_CONFIG, **kwargs)  # k = 4, n-grams of 2 to 5
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def test_greedy_outputs_on_the_grounded_chats_are_identical(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=96)
    for text in GROUNDED_CHATS.values():
        want = plain.chat(as_conversation(text), params, use_tqdm=False)[0].outputs[0]
        have = spec.chat(as_conversation(text), params, use_tqdm=False)[0].outputs[0]
        assert have.token_ids == want.token_ids
        assert have.spec_decode.num_accepted_tokens > 0


def test_greedy_chat_outputs_are_identical_and_report_acceptance(engines):
    plain, spec = engines
    params = [SamplingParams(temperature=0, max_tokens=48),
              SamplingParams(temperature=0, max_tokens=24, n=2, stop=["\n\n"])]
    expected = plain.chat(CHATS, params, use_tqdm=False)
    got = spec.chat(CHATS, params, use_tqdm=False)
    for want, have in zip(expected, got):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in have.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in want.outputs]
    copy = got[0].outputs[0].spec_decode
    assert copy is not None and copy.num_drafts > 0 and copy.num_accepted_tokens > 0
    assert 0 < copy.acceptance_rate <= 1 and copy.mean_accepted_length > 1
    assert all(c.spec_decode is None for c in expected[0].outputs)

