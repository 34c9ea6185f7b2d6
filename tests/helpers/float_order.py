"""How far float32 summation order alone may move the logits of the tiny test models (two
implementations of the same float32 math: native kernels against oneDNN/MKL, paged against
contiguous attention, another batching of the same rows).

The derivation. Reordering a float32 sum of n terms moves it by at most
gamma_n * sum|terms|, gamma_n ~ n * 2**-24 (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1). In the tiny models (hidden 64, MLP width <= 128, contexts < 128 tokens) no
reduction has more than 128 terms: 7.6e-6. A layer chains at most 9 reductions (two RMSNorms,
QKV, attention scores, the softmax's sum, the weighted values, the output projection, gate/up,
down), the head 2 more (the final norm, the LM head). RMSNorm rescales every layer's input and
the random weights' large init leaves sum|terms| about the size of the result (no cancellation),
so the errors of the stages add, each of at most gamma_128 of the logits' scale:
(9 * layers + 2) * 7.6e-6 — 2.9e-4 for the 4-layer models, far below a real error (a wrong
weight or token moves logits by a large part of their range).

For a real model's widths (sums of 1,536 terms over 30 layers) that worst case is loose: the
rounding errors of a sum are independent and of mean zero, so with probability at least
1 - 2 exp(-lambda**2 / 2) a sum errs by at most lambda * sqrt(n) * 2**-24 * sum|terms| (Higham and
Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019,
theorem 2.8); lambda = 6 leaves a chance of 3e-8 per sum (`likely=True`).
"""
from __future__ import annotations

FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24
WIDEST_REDUCTION = 128
REDUCTIONS_PER_LAYER = 9
REDUCTIONS_IN_HEAD = 2
TINY_MODEL_MAX_LAYERS = 4
PROBABILISTIC_LAMBDA = 6.0


def float32_reorder_bound(num_layers: int = TINY_MODEL_MAX_LAYERS, widest: int = WIDEST_REDUCTION,
                          likely: bool = False) -> float:
    """The largest move, relative to the logits' scale (at least 1), that reordering the float32
    sums of a model of `num_layers` layers whose widest reduction has `widest` terms can make
    (with `likely`, the probabilistic bound: see the module docstring)."""
    per_sum = PROBABILISTIC_LAMBDA * widest ** 0.5 if likely else widest
    return (REDUCTIONS_PER_LAYER * num_layers + REDUCTIONS_IN_HEAD) * per_sum * FLOAT32_UNIT_ROUNDOFF


TINY_MODEL_REORDER_BOUND = float32_reorder_bound()
