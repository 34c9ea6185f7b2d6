"""Verifying draft tokens against the target model in one pass (speculative decoding).

For a request with drafts d_1..d_k the step computes k + 1 target
distributions: p_j (row j, after d_1..d_j-1 were fed) for j = 0..k.

Greedy rows: d_j is accepted while it equals the argmax of p_j; the first
mismatch emits that argmax instead, and if every draft is accepted the
argmax of p_k follows as a bonus token. The tokens are exactly those of
plain greedy decoding.

Random rows: drafts come from a deterministic proposer (prompt lookup), a
point mass q_j = 1[d_j]. d_j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j); on rejection the token is drawn from
the residual max(p_j - q_j, 0), i.e. p_j without d_j, renormalised. Each
emitted token is then distributed exactly as p_j, so the output keeps the
target distribution.

Drafts sampled from a draft model's distribution q_j (given as `draft_probs`)
follow the same rule with that q_j: accept with probability
min(1, p_j(d_j) / q_j(d_j)), else draw from max(p_j - q_j, 0) renormalised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.sample.sampler import Sampler, SamplingTensors, gather_logprobs
from kvserve.messages import TokenLogprobs


@dataclass
class VerifiedTokens:
    """Per request: the emitted tokens (accepted drafts, then one more) and their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]


def verify_drafts(sampler: Sampler, logits: torch.Tensor, st: SamplingTensors,
                  drafts: list[list[int]],
                  draft_probs: list[torch.Tensor | None] | None = None) -> VerifiedTokens:
    """Accept or reject each request's drafts.

    `logits` has 1 + len(drafts[i]) rows per request i, in order, and `st` one
    row per logits row (row j of request i sees drafts[i][:j] as outputs).
    `draft_probs[i]` ([len(drafts[i]), vocab]) is the distribution request i's
    drafts were sampled from; None means a deterministic proposer.
    """
    logits = logits.float()
    want_logprobs = any(n is not None for n in st.num_logprobs)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    processed = sampler.process_logits(logits, st)
    greedy_tokens = processed.argmax(dim=-1).tolist()
    probs = None if st.all_greedy else sampler.target_probs(processed, st)
    temperatures = st.temperature.tolist()
    token_ids, rows_used = [], []
    first_row = 0
    for i, draft in enumerate(drafts):
        if temperatures[first_row] == 0:
            emitted = _accept_greedy(draft, greedy_tokens[first_row:first_row + len(draft) + 1])
        else:
            emitted = _accept_random(draft, probs[first_row:first_row + len(draft) + 1],
                                     st.generators[first_row], draft_probs[i] if draft_probs else None)
        token_ids.append(emitted)
        rows_used.append(list(range(first_row, first_row + len(emitted))))
        first_row += len(draft) + 1
    logprobs = [None] * len(drafts)
    if raw_logprobs is not None:
        logprobs = _logprobs(raw_logprobs, token_ids, rows_used, st.num_logprobs)
    return VerifiedTokens(token_ids, logprobs)


def _accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    emitted = []
    for draft_token, target in zip(draft, targets):
        emitted.append(target)
        if draft_token != target:
            return emitted
    emitted.append(targets[len(draft)])
    return emitted


def _accept_random(draft: list[int], probs: torch.Tensor, generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    emitted = []
    for j, draft_token in enumerate(draft):
        p = probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, draft_token])
        if float(torch.rand((), generator=generator)) * q_token < float(p[draft_token]):
            emitted.append(draft_token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft_token] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[j].to(p.dtype), min=0.0)
        if float(residual.sum()) <= 0.0:  # p equals q (numerically): accept after all
            emitted.append(draft_token)
            continue
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return emitted


def _logprobs(raw_logprobs: torch.Tensor, token_ids: list[list[int]], rows_used: list[list[int]],
              num_logprobs: list[int | None]) -> list[list[TokenLogprobs] | None]:
    rows = [row for rows in rows_used for row in rows]
    flat = gather_logprobs(raw_logprobs[rows], [t for tokens in token_ids for t in tokens],
                           [num_logprobs[row] for row in rows])
    out, start = [], 0
    for tokens in token_ids:
        entries = flat[start:start + len(tokens)]
        start += len(tokens)
        out.append(None if entries[0] is None else entries)
    return out
