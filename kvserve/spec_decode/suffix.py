"""Suffix decoding: drafts from suffix trees of the request's tokens and of earlier outputs.

As in vLLM's `suffix` method (Arctic Inference's suffix decoding), without
its code. Every sequence is indexed by a suffix tree cut at `max_depth`
tokens: each start position inserts the path of the `max_depth` tokens that
follow it, and every node counts the occurrences of its path. One tree per
live request holds its prompt and outputs (grown as tokens arrive); one
global tree holds the outputs of the latest `max_cached_requests` finished
requests, so an answer repeated across requests is drafted.

A draft: the longest suffix of the request's tokens (up to `max_depth` - 1
tokens) that is a path of a tree; then, from that node, the most frequent
child while its share of its parent's count is at least `min_token_prob`,
at most `max_spec_factor` x the match length and the caller's cap. Of the
two trees' drafts the one with the higher score (the sum of those shares)
wins.

Importing this module needs no torch.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Node:
    count: int = 0
    children: dict[int, "_Node"] = field(default_factory=dict)


class SuffixTree:
    """Counts of every path of at most `max_depth` tokens in the sequences added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def add(self, tokens: Sequence[int], start: int = 0, sign: int = 1) -> None:
        """Count the occurrences `tokens` has beyond its first `start` tokens (those
        were added before: the sequence grew), i.e. every path ending at a position
        >= `start`. `sign` -1 removes a whole sequence added before."""
        first = max(0, start - self.max_depth + 1)
        for begin in range(first, len(tokens)):
            node = self.root
            for position in range(begin, min(begin + self.max_depth, len(tokens))):
                node = node.children.setdefault(tokens[position], _Node())
                if position >= start:
                    node.count += sign
            if sign < 0:
                _prune(self.root, tokens[begin:begin + self.max_depth])

    def match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most max_depth - 1 tokens)
        that is a path here, and its length; (None, 0) when not even one token is."""
        for length in range(min(self.max_depth - 1, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length:]:
                node = node.children.get(token)
                if node is None or node.count <= 0:
                    break
            else:
                return node, length
        return None, 0

    def draft(self, context: Sequence[int], num_tokens: int, max_spec_factor: float,
              min_token_prob: float) -> tuple[list[int], float]:
        """Up to `num_tokens` tokens continuing `context`, and their score."""
        node, match_length = self.match(context)
        if node is None:
            return [], 0.0
        num_tokens = min(num_tokens, int(max_spec_factor * match_length + 1e-9))
        tokens, score = [], 0.0
        while len(tokens) < num_tokens and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            share = child.count / node.count if node.count > 0 else 0.0
            if share < min_token_prob or child.count <= 0:
                break
            tokens.append(token)
            score += share
            node = child
        return tokens, score


def _prune(root: _Node, path: Sequence[int]) -> None:
    """Drop the nodes along `path` whose count fell to zero."""
    node = root
    for token in path:
        child = node.children.get(token)
        if child is None:
            return
        if child.count <= 0:
            del node.children[token]
            return
        node = child


class SuffixProposer:
    """Per-request trees plus the global tree of finished requests' outputs."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_depth)
        self._cached_outputs: OrderedDict[str, list[int]] = OrderedDict()
        # Request id -> (its tree, how many of its tokens are in it).
        self._request_trees: dict[str, tuple[SuffixTree, int]] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens after `token_ids` (the request's tokens so far)."""
        # The request's tree holds all but its last token, so a match is always an
        # earlier occurrence (the context's own end has nothing after it).
        tree, num_indexed = self._request_trees.get(request_id) or (SuffixTree(self.max_depth), 0)
        indexed = token_ids[:-1]
        if num_indexed < len(indexed):
            tree.add(indexed, start=num_indexed)
        self._request_trees[request_id] = (tree, max(num_indexed, len(indexed)))
        own, own_score = tree.draft(token_ids, num_tokens, self.max_spec_factor, self.min_token_prob)
        cached, cached_score = self.global_tree.draft(token_ids, num_tokens, self.max_spec_factor,
                                                      self.min_token_prob)
        return own if own_score >= cached_score else cached

    def finish(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """Forget the request's tree; cache its outputs (evicting the oldest beyond the cap)."""
        self._request_trees.pop(request_id, None)
        if self.max_cached_requests <= 0 or not output_token_ids:
            return
        outputs = list(output_token_ids)
        self._cached_outputs[request_id] = outputs
        self.global_tree.add(outputs)
        while len(self._cached_outputs) > self.max_cached_requests:
            _, evicted = self._cached_outputs.popitem(last=False)
            self.global_tree.add(evicted, sign=-1)

