"""The draft model of speculative decoding (`"method": "draft_model"`), run by the ModelRunner.

After the target verified and sampled a step, the draft:
  1. catches up in one pass over the tokens the target processed in that
     step, less the drafts it rejected, plus, for the requests the scheduler
     asked to propose for, the token just sampled (its logits give draft 1);
  2. feeds each new draft token in a one-token pass, k - 1 times.
Its layers are named `draft.model.layers.*`, so the KV-cache layout gives
them groups of their own in the target's manager, on the same block-table
rows: the draft's KV covers every position the target's does, written in the
same step, so prefix hits, copy-on-write copies, preemption, rollback and
deferred frees treat both alike. Pass 2 writes the positions after the
sampled token, which the scheduler holds as lookahead slots.

Greedy requests propose the draft's argmax. Others sample from the draft's
softmax(logits / temperature); those distributions are kept for the
rejection sampler of the next step (accept with min(1, p / q)).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvserve.kv_cache.interface import KVCacheConfig, KVCacheSpec
from kvserve.model.loader import load_model
from kvserve.worker.input_batch import InputBatch, PreparedBatch

DRAFT_LAYER_PREFIX = "draft."


class DraftModelProposer:
    """Holds the draft model and proposes `num_speculative_tokens` tokens per request."""

    def __init__(self, model_config, num_speculative_tokens: int, device: torch.device,
                 max_model_len: int) -> None:
        self.model_config = model_config
        self.num_speculative_tokens = num_speculative_tokens
        self.device = device
        self.max_model_len = max_model_len
        self.model = None
        self.kv_cache_dtype = model_config.dtype  # set by load_model
        # Request id -> its latest proposal and, for sampled (not greedy) requests,
        # the distributions [k, vocab] its tokens were drawn from.
        self._proposals: dict[str, tuple[list[int], torch.Tensor | None]] = {}

    def load_model(self, kernel_config, kv_cache_dtype: str) -> None:
        """Load the draft's weights, with the same kernel choices as the target, for a KV
        cache of `kv_cache_dtype` (resolved as the target's: a full-depth draft of a quantized
        target then reads and writes K/V exactly as the target does)."""
        self.kv_cache_dtype = kv_cache_dtype
        self.model = load_model(self.model_config, device=str(self.device), kernel_config=kernel_config,
                                kv_cache_dtype=getattr(torch, kv_cache_dtype))
        self.model.prefix_kv_layer_names(DRAFT_LAYER_PREFIX)
        if self.model.kernels.packed_weights:
            self.model.pack_linear_weights()

    def kv_cache_specs(self, block_size: int, sliding_window_kv: str) -> dict[str, KVCacheSpec]:
        return self.model.kv_cache_specs(block_size, self.kv_cache_dtype, sliding_window_kv=sliding_window_kv)

    def bind_kv_cache_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model.bind_kv_cache_config(kv_cache_config)

    def fill_placeholders(self, scheduled_drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """The scheduled drafts with placeholders (-1) replaced by the latest proposal,
        cut to the scheduled count (padded with its last token when shorter: any
        token is a valid draft, it is only less likely accepted)."""
        filled = {}
        for req_id, draft in scheduled_drafts.items():
            if draft and draft[0] < 0:
                proposal = self._proposals.get(req_id, ([], None))[0] or [0]
                draft = (proposal + proposal[-1:] * len(draft))[:len(draft)]
            filled[req_id] = draft
        return filled

    def draft_probs_for(self, req_id: str, draft: list[int]) -> torch.Tensor | None:
        """The distributions `draft` was sampled from (None for greedy proposals); padded
        tokens beyond the proposal get a point mass."""
        proposal, probs = self._proposals.pop(req_id, ([], None))
        if probs is None or proposal[:len(draft)] != draft[:len(proposal)]:
            return None
        probs = probs[:len(draft)]
        if len(draft) > len(probs):
            padding = torch.zeros(len(draft) - len(probs), probs.shape[1], dtype=probs.dtype, device=probs.device)
            padding[torch.arange(len(padding)), torch.tensor(draft[len(probs):])] = 1.0
            probs = torch.cat([probs, padding])
        return probs

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self._proposals.pop(req_id, None)

    def propose(self, batch: InputBatch, prepared: PreparedBatch, sampled: dict[str, list[int]],
                proposal_req_ids: set[str], kv_caches: dict[str, torch.Tensor],
                build_metadata: Callable[[PreparedBatch], list]) -> dict[str, list[int]]:
        """Catch the draft's KV up with the step, then propose for `proposal_req_ids`
        (those that sampled). Returns the drafts by request id."""
        req_ids, starts, tokens, proposing = self._catch_up_inputs(prepared, sampled, proposal_req_ids)
        self.forget(proposal_req_ids)
        if not req_ids:
            return {}
        step = batch.prepare_tokens(req_ids, np.array(starts), tokens)
        logits = self._forward_logits(step, step.logits_indices[proposing], kv_caches, build_metadata)
        active = [req_ids[i] for i in proposing]
        positions = [starts[i] + len(tokens[i]) - 1 for i in proposing]
        drafts: dict[str, list[int]] = {rid: [] for rid in active}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in active}
        next_tokens = self._pick(batch, logits, active, drafts, probs)
        for _ in range(self.num_speculative_tokens - 1):
            keep = [i for i, position in enumerate(positions) if position + 1 < self.max_model_len]
            if not keep:
                break
            active = [active[i] for i in keep]
            positions = [positions[i] + 1 for i in keep]
            step = batch.prepare_tokens(active, np.array(positions), [np.array([next_tokens[i]]) for i in keep])
            logits = self._forward_logits(step, step.logits_indices, kv_caches, build_metadata)
            next_tokens = self._pick(batch, logits, active, drafts, probs)
        for rid, draft in drafts.items():
            self._proposals[rid] = (draft, torch.stack(probs[rid]) if probs[rid] else None)
        return drafts

    def _catch_up_inputs(self, prepared: PreparedBatch, sampled: dict[str, list[int]],
                         proposal_req_ids: set[str]):
        """Per request: the step's tokens the draft must process (rejected drafts cut,
        the sampled token appended where it proposes); and which ones propose."""
        req_ids, starts, tokens, proposing = [], [], [], []
        num_drafts = prepared.num_draft_tokens
        for i, req_id in enumerate(prepared.req_ids):
            begin, num_tokens = int(prepared.query_start_loc[i]), int(prepared.num_scheduled_tokens[i])
            emitted = sampled.get(req_id)
            if emitted and num_drafts is not None and num_drafts[i]:
                num_tokens -= int(num_drafts[i]) - (len(emitted) - 1)
            start = int(prepared.num_computed_tokens[i])
            row_tokens = prepared.input_ids[begin:begin + num_tokens]
            if emitted and req_id in proposal_req_ids and start + num_tokens < self.max_model_len:
                row_tokens = np.append(row_tokens, emitted[-1])
                proposing.append(len(req_ids))
            req_ids.append(req_id)
            starts.append(start)
            tokens.append(row_tokens)
        return req_ids, starts, tokens, np.array(proposing, dtype=np.int64)

    def _forward_logits(self, step: PreparedBatch, logits_rows: np.ndarray, kv_caches: dict[str, torch.Tensor],
                        build_metadata: Callable[[PreparedBatch], list]) -> torch.Tensor:
        return self.model.forward_logits(torch.from_numpy(step.input_ids).to(self.device),
                                         torch.from_numpy(step.positions).to(self.device),
                                         build_metadata(step), kv_caches,
                                         torch.from_numpy(logits_rows).to(self.device))

    @staticmethod
    def _pick(batch: InputBatch, logits: torch.Tensor, req_ids: list[str], drafts: dict[str, list[int]],
              probs: dict[str, list[torch.Tensor]]) -> list[int]:
        """One draft token per request: argmax (greedy) or a sample of softmax(logits / T)."""
        picked = []
        for row, req_id in enumerate(req_ids):
            state = batch.states[req_id]
            params = state.sampling_params
            if params.is_greedy:
                token = int(logits[row].argmax())
            else:
                q = torch.softmax(logits[row] / params.temperature, dim=-1)
                token = int(torch.multinomial(q, 1, generator=state.generator))
                probs[req_id].append(q)
            drafts[req_id].append(token)
            picked.append(token)
        return picked
