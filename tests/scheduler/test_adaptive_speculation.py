"""Adaptive speculation: each draft as long as pays, none when acceptance is too low
(with a re-probe after the back-off), shorter in larger batches."""
from __future__ import annotations

import pytest

from kvserve.scheduler.speculation import Speculator, batch_draft_cost, best_draft_length
from kvserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from kvserve.testing import FakeModelRunner, create_requests, create_scheduler

from oracle import assert_pool_whole, assert_results_match


def _expected_tokens(acceptance: float, length: int) -> float:
    """Tokens a step emits with `length` drafts: j accepted (then the bonus token) with
    probability a^j (1 - a), all of them with a^length."""
    exact = [acceptance ** j * (1 - acceptance) for j in range(length)] + [acceptance ** length]
    return sum(probability * (j + 1) for j, probability in enumerate(exact))


@pytest.mark.parametrize("acceptance", [0.0, 0.2, 0.45, 0.6, 0.75, 0.9, 1.0])
@pytest.mark.parametrize("cost", [0.1, 0.25, 0.5, 0.9])
def test_best_length_maximizes_expected_tokens_per_cost(acceptance, cost):
    gains = [_expected_tokens(acceptance, n) / (1 + cost * n) for n in range(5)]
    best = best_draft_length(acceptance, cost, 4)
    assert gains[best] == pytest.approx(max(gains))
    assert gains[best] > 1.0 or best == 0


def test_a_draft_token_costs_more_in_larger_batches():
    costs = [batch_draft_cost(0.25, n) for n in (1, 2, 4, 8, 64)]
    assert costs[0] == pytest.approx(0.25)
    assert costs == sorted(costs) and costs[-1] < 1.0
    assert batch_draft_cost(1.0, 3) == 1.0
    with pytest.raises(SpeculativeConfigError, match="draft_token_cost"):
        SpeculativeConfig(draft_token_cost=1.5)


def test_draft_length_follows_acceptance_and_batch_size():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.0, backoff_steps=3))
    request = create_requests(1)[0]
    rid = request.request_id
    speculator.begin_step()
    first = speculator.draft_length(rid, 1)
    assert 0 < first < 4  # no history yet: a prior of 0.7, a short first draft
    speculator.record(rid, first, first)
    speculator.record(rid, 4, 4)
    assert speculator.draft_length(rid, 1) == 4
    speculator.record(rid, 4, 2)
    speculator.record(rid, 4, 2)  # about 0.6 accepted now
    by_batch = [speculator.draft_length(rid, n) for n in (1, 2, 4, 8)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] >= 2 and by_batch[-1] == 0
    assert speculator.wants_drafts(request, 1) and not speculator.wants_drafts(request, 8)
    # Drafts keep failing: shorter, then none, and the request backs off ...
    lengths = []
    while speculator.wants_drafts(request, 1):
        lengths.append(speculator.draft_length(rid, 1))
        speculator.record(rid, lengths[-1], 0)
    assert lengths == sorted(lengths, reverse=True) and len(lengths) <= 8
    for _ in range(3):
        assert not speculator.wants_drafts(request, 1)
        speculator.begin_step()
    # ... and probes again from the prior after the back-off: accepted, drafts grow back.
    assert speculator.wants_drafts(request, 1) and speculator.draft_length(rid, 1) == first
    speculator.record(rid, first, first)
    speculator.record(rid, 4, 4)
    assert speculator.draft_length(rid, 1) == 4
    # Without a cost, every draft is k long whatever the acceptance.
    plain = Speculator(SpeculativeConfig(num_speculative_tokens=4, draft_token_cost=0.0, min_acceptance_rate=0.0))
    plain.record(rid, 4, 0)
    assert plain.draft_length(rid, 8) == 4


class PhasedRunner(FakeModelRunner):
    """Outputs that repeat every 4 tokens, then (outputs 24-71) a fixed token between fresh
    ones, so every lookup finds an old continuation that is wrong, then repeat again."""

    def token_for(self, request_id: str, position: int, prompt_len: int) -> int:
        index = position - prompt_len
        if index < 24:
            return 11 + index % 4
        if index < 72:
            return 50 if index % 2 == 0 else 100 + index
        return 21 + index % 4


def test_proposals_stop_when_acceptance_falls_and_resume_when_it_recovers():
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3, backoff_steps=6)
    scheduler = create_scheduler(block_size=4, max_num_batched_tokens=64, max_model_len=300, speculative_config=spec)
    runner = PhasedRunner(block_size=4)
    request = create_requests(1, prompt_token_ids=[[5, 6, 7, 8]], max_tokens=120)[0]
    scheduler.add_request(request)
    steps = []  # (outputs before the step, drafts, tokens emitted)
    while not request.is_finished():
        out = scheduler.schedule()
        before = request.num_output_tokens
        scheduler.update_from_output(out, runner.execute(out))
        drafts = out.scheduled_spec_decode_tokens.get(request.request_id, [])
        steps.append((before, len(drafts), request.num_output_tokens - before))
    first, bad, last = ([s for s in steps if lo <= s[0] < hi] for lo, hi in ((8, 18), (34, 72), (84, 120)))
    assert max(d for _, d, _ in first) == 4 and all(e == d + 1 for _, d, e in first if d)
    # Every draft fails in the bad phase: speculation stops for most of its steps.
    assert sum(1 for _, d, _ in bad if d == 0) > 0.7 * len(bad)
    assert all(e == 1 for _, _, e in bad)
    # Repeating again: after a back-off the request probes, is accepted, drafts k again.
    assert max(d for _, d, _ in last) == 4 and sum(e for _, _, e in last) > 1.5 * len(last)
    assert_results_match(runner, [request], {request.request_id: _result(request)}, scheduler.max_model_len)
    assert_pool_whole(scheduler)


def _result(request):
    from kvserve.testing import RequestResult
    return RequestResult(list(request.output_token_ids), request.get_finished_reason(), request.stop_reason)
