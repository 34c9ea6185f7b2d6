"""Recording the router logits of the per-op path's MoE blocks (kvserve.model.moe.route), to keep
the tests that compare two float orders off routing decisions rounding could flip."""
from __future__ import annotations

from kvserve.model import moe

_ROUTE = moe.route


class RouterLogits:
    """`moe.route` that keeps every call's router logits and picks (patch it in as moe.route)."""

    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, logits, top_k, renormalize, softmax_after_topk=False):
        weights, ids = _ROUTE(logits, top_k, renormalize, softmax_after_topk)
        self.calls.append((logits.detach().float().clone(), ids.clone()))
        return weights, ids

    def min_margin(self, top_k: int) -> float:
        """The smallest gap between the k-th and (k+1)-th router logit, relative to the logits'
        scale (at least 1), over every token and call, exact ties excluded."""
        gaps = []
        for logits, _ in self.calls:
            top = logits.topk(top_k + 1, dim=-1).values
            gap = (top[:, top_k - 1] - top[:, top_k]) / logits.abs().amax(-1).clamp(min=1.0)
            gaps += [g for g in gap.tolist() if g > 0]
        return min(gaps)
