"""Draft verification: greedy acceptance, and rejection sampling that keeps the
target distribution (chi-square against the exact probabilities)."""
from __future__ import annotations

import torch
from scipy.stats import chisquare

from kvserve.sample.rejection_sampler import verify_drafts
from kvserve.sample.sampler import Sampler, SamplingTensors
from kvserve.sampling_params import SamplingParams

VOCAB = 6
NUM_TRIALS = 6000


def _tensors(params: SamplingParams, num_rows: int) -> SamplingTensors:
    return SamplingTensors.from_params([params] * num_rows, output_token_ids=[[] for _ in range(num_rows)])


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    logits = torch.full((4, VOCAB), -5.0)
    for row, token in enumerate([3, 1, 4, 2]):
        logits[row, token] = 5.0
    st = _tensors(SamplingParams(temperature=0.0), 4)
    assert verify_drafts(Sampler(), logits, st, [[3, 1, 4]]).token_ids == [[3, 1, 4, 2]]
    assert verify_drafts(Sampler(), logits, st, [[3, 5, 4]]).token_ids == [[3, 1]]
    assert verify_drafts(Sampler(), logits, st, [[0, 1, 4]]).token_ids == [[3]]


def _assert_distributed_as(samples: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    keep = expected >= 5  # chi-square needs expected counts of a few; pool the rest
    observed = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    expected = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
        expected = expected * observed.sum() / expected.sum()
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3, (counts.tolist(), probs.tolist())


def test_rejection_sampling_keeps_the_target_distribution():
    """Two drafted positions at temperature 0.8 with top-k 5: the first emitted token is
    distributed as p0 whatever the draft, the second (after an accepted first draft) as p1,
    and the bonus after two accepted drafts as p2."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.8, top_k=5)
    base_logits = torch.randn(3, VOCAB) * 1.5
    st_rows = _tensors(params, 3 * NUM_TRIALS)
    probs = Sampler.target_probs(base_logits, _tensors(params, 3))
    draft = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]  # likely, but far from sure
    verified = verify_drafts(Sampler(), base_logits.repeat(NUM_TRIALS, 1), st_rows, [draft] * NUM_TRIALS)
    first = [tokens[0] for tokens in verified.token_ids]
    second = [tokens[1] for tokens in verified.token_ids if len(tokens) > 1]
    third = [tokens[2] for tokens in verified.token_ids if len(tokens) > 2]
    assert all(tokens[:-1] == draft[:len(tokens) - 1] for tokens in verified.token_ids)
    assert 0.2 * NUM_TRIALS < len(second) < 0.8 * NUM_TRIALS  # both outcomes happen often
    _assert_distributed_as(first, probs[0])
    _assert_distributed_as(second, probs[1])
    _assert_distributed_as(third, probs[2])


def test_seeded_rows_reproduce():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, VOCAB)

    def run():
        generator = torch.Generator().manual_seed(7)
        st = SamplingTensors.from_params([params] * 3, output_token_ids=[[], [], []],
                                         generators=[generator] * 3)
        return verify_drafts(Sampler(), logits, st, [[1, 2]]).token_ids

    assert run() == run()
