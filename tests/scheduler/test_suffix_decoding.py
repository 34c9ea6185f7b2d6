"""Suffix decoding's proposer: suffix trees cut at a depth, of a request's own tokens and
of finished requests' outputs (torch-free)."""
from __future__ import annotations

import random

import pytest

from kvserve.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from kvserve.spec_decode.suffix import SuffixProposer, SuffixTree


def _paths(node, path=()) -> dict[tuple[int, ...], int]:
    out = {path: node.count} if path else {}
    for token, child in node.children.items():
        out.update(_paths(child, path + (token,)))
    return out


def _brute_force_paths(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for tokens in sequences:
        for begin in range(len(tokens)):
            for end in range(begin + 1, min(begin + depth, len(tokens)) + 1):
                counts[tuple(tokens[begin:end])] = counts.get(tuple(tokens[begin:end]), 0) + 1
    return counts


def test_tree_counts_every_path_up_to_its_depth_grown_or_whole_and_removal_prunes():
    rng = random.Random(0)
    sequences = [[rng.randrange(4) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    whole, grown = SuffixTree(5), SuffixTree(5)
    for tokens in sequences:
        whole.add(tokens)
        for n in range(1, len(tokens) + 1):
            grown.add(tokens[:n], start=n - 1)
    assert _paths(whole.root) == _paths(grown.root) == _brute_force_paths(sequences, 5)
    whole.add(sequences[0], sign=-1)
    assert _paths(whole.root) == _brute_force_paths(sequences[1:], 5)


def test_draft_follows_the_longest_match_and_the_most_frequent_continuation():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=4, max_spec_factor=2.0, min_token_prob=0.1)
    # [1, 2] occurs twice before the end: followed by 3 then by 7; [9, 1, 2] only by 7.
    assert proposer.propose("a", [1, 2, 3, 4, 9, 1, 2, 7, 5, 9, 1, 2], 4) == [7, 5, 9, 1]
    # Match length 1 with factor 2: at most 2 tokens.
    assert proposer.propose("b", [4, 5, 6, 4], 8) == [5, 6]
    assert proposer.propose("c", [1, 2, 3], 4) == []  # nothing recurs


def test_min_token_prob_stops_the_draft_at_an_uncertain_token():
    tokens = [8, 1, 2, 8, 1, 3, 8, 1, 4, 8, 1, 5, 8]
    strict = SuffixProposer(max_depth=8, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.5)
    assert strict.propose("a", tokens, 4) == [1]  # after [8, 1] each of 2..5 has a quarter
    loose = SuffixProposer(max_depth=8, max_cached_requests=0, max_spec_factor=4.0, min_token_prob=0.2)
    assert loose.propose("a", tokens, 4)[:1] == [1] and len(loose.propose("a", tokens, 4)) >= 2


def test_finished_outputs_are_drafted_for_later_requests_until_evicted():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=1, max_spec_factor=4.0, min_token_prob=0.1)
    proposer.propose("a", [5, 6], 4)
    proposer.finish("a", [20, 21, 22, 23, 24])
    assert proposer.propose("b", [7, 20, 21], 3) == [22, 23, 24]
    proposer.finish("b", [30, 31])  # the cache holds one request: "a" is evicted
    assert proposer.propose("c", [7, 20, 21], 3) == []
    assert proposer.propose("d", [9, 30], 3) == [31]
    assert set(proposer.global_tree.root.children) == {30, 31}


@pytest.mark.parametrize("value,message", [
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth must be >= 1"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob must be in"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": "x"}, "must be a number"),
])
def test_bad_suffix_configs_are_one_line_errors(value, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.from_value(value)
