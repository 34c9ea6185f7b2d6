"""Sampler: greedy, seeded reproducibility, top-k/top-p/min-p support sets,
penalties as defined by OpenAI (presence/frequency) and HF (repetition), logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.sample.sampler import Sampler, SamplingTensors, apply_penalties, argmax_token_ids, make_generator
from kvserve.sampling_params import SamplingParams

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _sample(logits, params, outputs=None, prompts=None, generators=None, eos=None):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    st = SamplingTensors.from_params(params, outputs, prompts, generators, eos_token_ids=eos)
    return Sampler().sample(logits, st)


def test_greedy_is_argmax():
    logits = _logits(4)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_argmax_token_ids_picks_what_torch_argmax_picks():
    """Ties go to the first maximal entry and NaN counts as maximal, as in torch.argmax;
    strided rows (the native call's logits cut to the vocabulary) are read as they are."""
    logits = _logits(6, seed=3)
    logits[1, 10] = logits[1, 30] = logits[1].max() + 1  # a tie
    logits[2, 7] = float("nan")
    logits[3, 4] = logits[3, 9] = float("nan")
    logits[4, :] = 0.0
    logits[5, 3] = float("inf")
    wide = torch.cat([logits, torch.full((6, 5), 1e9)], dim=1)[:, :VOCAB]
    for rows in (logits, wide):
        assert argmax_token_ids(rows) == rows.argmax(-1).tolist() == [rows[0].argmax().item(), 10, 7, 4, 0, 3]


def test_seeded_rows_reproducible_regardless_of_batch():
    logits = _logits(5, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=7)

    def run(batch_rows: list[int], target: int, steps: int = 20) -> list[int]:
        generators = [make_generator(7) if r == target else None for r in batch_rows]
        params = [seeded if r == target else SamplingParams(temperature=0.8) for r in batch_rows]
        tokens = []
        for _ in range(steps):
            out = _sample(logits[batch_rows], params, generators=generators)
            tokens.append(out.token_ids[batch_rows.index(target)])
        return tokens

    alone = run([2], 2)
    assert run([0, 2, 4], 2) == alone
    assert run([4, 1, 3, 2, 0], 2) == alone
    assert len(set(alone)) > 1  # it does sample, not argmax


def _allowed_top_k(logits: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(logits, k).indices.tolist())


def _allowed_top_p(logits: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(logits, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    allowed, mass = set(), 0.0
    for i in order:
        allowed.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return allowed


def _allowed_min_p(logits: torch.Tensor, min_p: float) -> set[int]:
    probs = torch.softmax(logits, -1)
    return set((probs >= min_p * probs.max()).nonzero().flatten().tolist())


@pytest.mark.parametrize("kind,value,oracle", [
    ("top_k", 5, _allowed_top_k), ("top_p", 0.6, _allowed_top_p), ("min_p", 0.05, _allowed_min_p)])
def test_filters_never_emit_outside_allowed_set(kind, value, oracle):
    logits = _logits(1, seed=2)[0]
    allowed = oracle(logits, value)
    assert 1 < len(allowed) < VOCAB
    params = [SamplingParams(temperature=1.0, **{kind: value})] * 400
    out = _sample(logits.expand(400, -1).clone(), params)
    drawn = set(out.token_ids)
    assert drawn <= allowed
    assert len(drawn) > 1


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = torch.tensor(_sample(logits.expand(4000, -1).clone(), params).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.03)


def test_temperature_sharpens():
    logits = torch.tensor([[0.0, 1.0]]).expand(3000, -1).clone()
    cold = torch.tensor(_sample(logits, [SamplingParams(temperature=0.25)] * 3000).token_ids).float().mean()
    expected = 1 / (1 + math.exp(-4.0))
    assert abs(cold.item() - expected) < 0.03


def test_presence_and_frequency_penalties_as_openai_defines():
    logits = _logits(1, seed=3)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    outputs = [[3, 3, 3, 7]]
    st = SamplingTensors.from_params([params], outputs, [[9]])
    penalized = apply_penalties(logits.clone(), st)
    expected = logits.clone()
    for token, count in ((3, 3), (7, 1)):
        expected[0, token] -= count * 0.25 + 0.5
    assert torch.allclose(penalized, expected)


def test_repetition_penalty_as_transformers_defines():
    from transformers import RepetitionPenaltyLogitsProcessor
    logits = _logits(1, seed=4)
    prompt, output = [1, 5, 8], [5, 11, 12]
    st = SamplingTensors.from_params([SamplingParams(repetition_penalty=1.3)], [output], [prompt])
    ours = apply_penalties(logits.clone(), st)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.allclose(ours, theirs)


def test_greedy_with_penalty_changes_choice():
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    logits[0, 6] = 0.9
    out = _sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[4]])
    assert out.token_ids == [6]


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 10.0
    logits[0, 9] = 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    assert _sample(logits, [params], outputs=[[5]], eos=[2]).token_ids != [2]
    assert _sample(logits, [params], outputs=[[5]], eos=[2]).token_ids != [9]
    assert _sample(logits, [params], outputs=[[5, 5, 5]], eos=[2]).token_ids == [2]


def test_logprobs_of_sampled_and_top_tokens():
    logits = _logits(2, seed=5)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = _sample(logits, params)
    reference = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert out.logprobs[1] is None
    assert first.sampled_token_id == out.token_ids[0]
    assert first.sampled_rank == 1
    assert math.isclose(first.sampled_logprob, reference[0].max().item(), rel_tol=1e-5)
    top = torch.topk(reference[0], 3)
    assert first.top_token_ids == top.indices.tolist()
    assert torch.allclose(torch.tensor(first.top_logprobs), top.values)


def test_logprob_rank_of_a_sampled_non_top_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=4, logprobs=0, seed=0)]
    for seed in range(30):
        out = _sample(logits, params, generators=[make_generator(seed)])
        token = out.token_ids[0]
        assert out.logprobs[0].sampled_rank == 1 + sorted([3, 2, 1, 0], reverse=True).index(logits[0, token].item())
        assert out.logprobs[0].top_token_ids == []
