"""Float64 attention over a paged KV cache as stored: the oracle of the attention kernels' tests
(csrc/attention/paged_attention.c, csrc/attention/prefill_attention.c)."""
from __future__ import annotations

import torch


def paged_reference(q, cache, block_table, table_row, positions, window, scale, softcap, sinks=None, weights=False):
    """Float64 attention of each token (row t of q [T, Hq, D]) over the keys it may read,
    max(0, pos - window + 1)..pos of the request in row table_row[t] of block_table, gathered
    position by position from cache [2, Hkv, blocks, block_size, D]. With `weights`, also
    sum_j p_j |v_j| [T, Hq, D] (the scale of an error in the probabilities) and the largest
    sum_d |q_d k_d| * scale and |score| of each token's keys [T, Hq] (the scale of an error in
    the scores), as (out, weighted_abs_values, abs_products, abs_scores)."""
    _, hkv, _, bs, d = cache.shape
    hq = q.shape[1]
    k_all, v_all = cache[0].double(), cache[1].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    abs_values, abs_products, abs_scores = torch.empty_like(out), torch.empty(q.shape[:2]), torch.empty(q.shape[:2])
    for t in range(q.shape[0]):
        pos = int(positions[t])
        lo = max(0, pos - window + 1) if window else 0
        keys = torch.arange(lo, pos + 1)
        blocks, slots = block_table[int(table_row[t])][keys // bs], keys % bs
        k, v = k_all[:, blocks, slots], v_all[:, blocks, slots]  # [hkv, n, d]
        qt = q[t].double().view(hkv, hq // hkv, d)
        scores = torch.einsum("hgd,hnd->hgn", qt, k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            sink = sinks.double().view(hkv, hq // hkv, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[t] = torch.einsum("hgn,hnd->hgd", probs, v).reshape(hq, d)
        if weights:
            abs_values[t] = torch.einsum("hgn,hnd->hgd", probs, v.abs()).reshape(hq, d)
            abs_products[t] = (torch.einsum("hgd,hnd->hgn", qt.abs(), k.abs()) * scale).amax(-1).reshape(hq)
            abs_scores[t] = scores.abs().amax(-1).reshape(hq)
    return (out, abs_values, abs_products, abs_scores) if weights else out
