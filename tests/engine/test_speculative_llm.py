"""Speculative decoding through `LLM` with the default model: greedy outputs equal the
engine without it (stop strings, n > 1 included), and each completion reports its drafts."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams

CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
CHATS = [
    [{"role": "user", "content": f"Copy this code exactly:\n\n{CODE}"}],
    [{"role": "user", "content": "Name three colours."}],
]


@pytest.fixture(scope="module")
def engines():
    kwargs = dict(max_model_len=512, kv_cache_memory="32MiB")
    plain = LLM(**kwargs)
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
               **kwargs)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


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
