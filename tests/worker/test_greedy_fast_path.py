"""The runner's greedy fast path: a step whose every sampled request is plain greedy (no
logprobs, penalties, logit bias, grammar, min_tokens left, drafts) takes the argmax of the
logits without building sampling tensors. Its tokens equal the full sampler's; anything
that needs the logits processed takes the full path."""
from __future__ import annotations

import pytest

from engine_helpers import greedy_params, make_engine, run_checked
from kvserve.sample.sampler import Sampler
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.worker import model_runner
from kvserve.worker.input_batch import RequestState
from helpers.greedy_check import assert_greedy_continuations
from tiny_models import load_reference, random_prompts, save_tiny_model

MAX_TOKENS = 10
PROMPTS = random_prompts(3, 3, 20, seed=5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = save_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return path, load_reference(path)


@pytest.fixture
def calls(monkeypatch):
    """Counts of fast-path argmax steps and full-sampler steps."""
    counts = {"fast": 0, "sampler": 0}
    fast, sample = model_runner.argmax_token_ids, Sampler.sample

    def counted_fast(logits):
        counts["fast"] += 1
        return fast(logits)

    def counted_sample(self, logits, st):
        counts["sampler"] += 1
        return sample(self, logits, st)

    monkeypatch.setattr(model_runner, "argmax_token_ids", counted_fast)
    monkeypatch.setattr(Sampler, "sample", counted_sample)
    return counts


def _params(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **overrides})


def _run(path, params, async_scheduling=True):
    outputs, _ = run_checked(make_engine(path, async_scheduling=async_scheduling), PROMPTS, params)
    return [outputs[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_plain_greedy_takes_the_fast_path_with_the_full_paths_tokens(tiny_llama, calls, async_scheduling):
    path, reference = tiny_llama
    fast = _run(path, greedy_params(MAX_TOKENS), async_scheduling)
    assert_greedy_continuations(reference, PROMPTS, fast, MAX_TOKENS)
    assert calls["fast"] > 0 and calls["sampler"] == 0
    calls["fast"] = 0
    # logprobs need the full sampler: the argmax of the same logits, so the same tokens
    assert _run(path, greedy_params(MAX_TOKENS, logprobs=2), async_scheduling) == fast
    assert calls["fast"] == 0 and calls["sampler"] > 0


@pytest.mark.parametrize("extra", [dict(presence_penalty=0.5), dict(repetition_penalty=1.3),
                                   dict(logit_bias={7: 5.0}), dict(temperature=0.7, seed=3)])
def test_anything_between_logits_and_argmax_takes_the_full_sampler(tiny_llama, calls, extra):
    path, _ = tiny_llama
    _run(path, _params(**extra))
    assert calls["fast"] == 0 and calls["sampler"] > 0


@pytest.mark.parametrize("extra,plain", [({}, True), (dict(logprobs=0), False), (dict(frequency_penalty=0.1), False),
                                         (dict(logit_bias={3: -1.0}), False), (dict(temperature=1.0), False),
                                         (dict(structured_outputs=StructuredOutputsParams(regex="[0-9]+")), False)])
def test_which_requests_count_as_plain_greedy(extra, plain):
    state = RequestState("r", [1, 2], _params(**extra))
    assert state.plain_greedy is plain and state.takes_argmax is plain


def test_min_tokens_keeps_the_full_sampler_until_reached(tiny_llama, calls):
    path, expected = tiny_llama
    state = RequestState("r", [1, 2], greedy_params(MAX_TOKENS, min_tokens=4, stop_token_ids=[1]))
    assert state.plain_greedy and not state.takes_argmax
    state.output_token_ids += [5, 6, 7, 8]
    assert state.takes_argmax
    outputs, _ = run_checked(make_engine(path), PROMPTS[:1], greedy_params(MAX_TOKENS, min_tokens=4,
                                                                            stop_token_ids=[1]))
    assert calls["sampler"] == 4 and calls["fast"] == MAX_TOKENS - 4


def test_one_request_needing_logprobs_sends_the_step_to_the_full_sampler(tiny_llama, calls):
    """A mixed batch: the plain request's tokens are the same whichever path its step took."""
    path, reference = tiny_llama
    params = [greedy_params(MAX_TOKENS, logprobs=1), greedy_params(MAX_TOKENS), greedy_params(MAX_TOKENS)]
    assert_greedy_continuations(reference, PROMPTS, _run(path, params), MAX_TOKENS)
    assert calls["sampler"] > 0
