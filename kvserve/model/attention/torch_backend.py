"""The portable attention backend: torch ops only (CPU, and CUDA).

Per sub-batch of the plan, the cached keys are gathered as whole blocks and
attended with explicit matmuls (short queries) or SDPA; prompts with no cached
context attend to their own K/V causally, without a gather.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.attention.backend import AttentionBackend, AttentionParams
from kvserve.model.attention.metadata import AttentionPlan, AttentionSubBatch


class TorchAttentionBackend(AttentionBackend):
    """Attention with torch ops; runs on any device and dtype."""

    name = "torch"

    def store(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
        store_with_index_copy(kv_cache, k, v, plan)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               plan: AttentionPlan, params: AttentionParams) -> torch.Tensor:
        return attend_with_torch(q, k, v, kv_cache, plan, params, out=None)


def attend_with_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      plan: AttentionPlan, params: AttentionParams, out: torch.Tensor | None) -> torch.Tensor:
    """The plan's fresh prompts and sub-batches, written into `out` (allocated when None;
    rows of tokens the plan leaves to another path are kept as they are)."""
    num_kv_heads, block_size, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    scale, softcap, sinks = params.scale, params.softcap, params.sinks
    if kv_cache.dtype != k.dtype:
        # This step's K/V as the cache holds them: a token attends to the same values whether
        # its keys come from this step or from the cache (and as the native kernel reads them).
        k, v = k.to(kv_cache.dtype).to(k.dtype), v.to(kv_cache.dtype).to(v.dtype)
    for start, length in plan.fresh_prompts:
        out = q.new_empty(q.shape) if out is None else out
        end = start + length
        out[start:end] = _causal_prompt(q[start:end], k[start:end], v[start:end], scale, softcap, plan.window, sinks)
    for sub in plan.sub_batches:
        n, num_blocks = sub.key_blocks.shape
        # One gather for K and V of every request of the sub-batch: [2, Hkv, n, keys, D], in the
        # activations' dtype (a 16-bit cache under float32 activations computes in float32).
        keys, values = kv_cache.index_select(2, sub.key_blocks.flatten()).to(q.dtype).view(
            2, num_kv_heads, n, num_blocks * block_size, head_dim)
        if sub.new_keys:
            keys = torch.cat([keys, _rows(k, sub).permute(2, 0, 1, 3)], dim=2)
            values = torch.cat([values, _rows(v, sub).permute(2, 0, 1, 3)], dim=2)
        attended = _attend(_rows(q, sub), keys, values, sub.mask, scale, softcap, sinks)
        if sub.is_whole_batch:
            out = attended.reshape(q.shape)
        else:
            out = q.new_empty(q.shape) if out is None else out
            out[sub.out_index] = attended.flatten(0, 1)[sub.valid_rows]
    return out


def _causal_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None,
                   window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One prompt attending to itself: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    length = q.shape[0]
    if not softcap and sinks is None and (window is None or window >= length):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    pos = torch.arange(length, device=q.device)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[:, None] - pos[None, :] < window
    return _attend(q[None], k.permute(1, 0, 2)[:, None], v.permute(1, 0, 2)[:, None], mask[None], scale, softcap,
                   sinks)[0]


def _rows(x: torch.Tensor, sub: AttentionSubBatch) -> torch.Tensor:
    """This step's per-token tensor [T, H, D] as the sub-batch's padded [n, max_q, H, D]."""
    if sub.is_whole_batch:
        return x.view(sub.token_index.shape + x.shape[1:])
    return x[sub.token_index]


def store_with_index_copy(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> None:
    """The portable K/V write: one `index_copy_` per K and V over the flat slot rows."""
    kv_rows = kv_cache.view(2, kv_cache.shape[1], -1, kv_cache.shape[4])
    if plan.write_token_index is not None:
        k, v = k[plan.write_token_index], v[plan.write_token_index]
    kv_rows[0].index_copy_(1, plan.write_slots, k.transpose(0, 1).to(kv_rows.dtype))
    kv_rows[1].index_copy_(1, plan.write_slots, v.transpose(0, 1).to(kv_rows.dtype))


# torch's CPU SDPA kernel is slow for short queries (decode); the explicit path wins there.
_SDPA_MIN_QUERY_LEN = 32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n, Lq, Hq, D]; k/v: [Hkv, n, Lk, D]; mask: [n, Lq, Lk] -> [n, Lq, Hq, D].

    GQA without repeating K/V: the query heads of one KV head form the rows of one matmul.
    `sinks` [Hq]: a logit per query head joining every softmax (its probability dropped)."""
    n, lq, hq, d = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    if not softcap and sinks is None and lq >= _SDPA_MIN_QUERY_LEN:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask[:, None], scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    # [Hkv, n, group*Lq, D]
    qg = q.view(n, lq, hkv, group, d).permute(2, 0, 3, 1, 4).reshape(hkv, n, group * lq, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(hkv, n, group, lq, -1).masked_fill(~mask[None, :, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hkv, 1, group, 1, 1).expand(hkv, n, group, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        probs = probs.to(v.dtype).reshape(hkv, n, group * lq, -1)
    else:
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(hkv, n, group * lq, -1)
    out = torch.matmul(probs, v)  # [Hkv, n, group*Lq, D]
    return out.view(hkv, n, group, lq, d).permute(1, 3, 0, 2, 4).reshape(n, lq, hq, d)
