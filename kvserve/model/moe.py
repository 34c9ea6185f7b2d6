"""Mixture-of-experts layers: a router picks each token's top-k experts, and the step's
tokens are grouped by expert so that each active expert's weights are read once.

Routing follows the families kvserve serves (Qwen3-MoE, Mixtral, OLMoE): a softmax over
all experts' router logits in float32, the top k of it (torch.topk, so ties go the way
transformers breaks them), renormalized to sum to 1 where the family says so (Mixtral
always, Qwen3-MoE / OLMoE by `norm_topk_prob`).

Dispatch: the (token, expert) pairs are sorted by expert id (see `group_by_expert`);
each expert with at least one token runs its gated MLP once on its tokens' rows (one
matmul per projection, through the same kernels as a dense MLP: float, packed or
quantized as stored), scales them by their gate weights and adds them into the output
with `index_add_`. Experts are summed in ascending id and an expert's rows gathered in
transformers' order, so in float32 the sums are formed in the same order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.config import ModelConfig
from kvserve.model.parallel import TPContext
from kvserve.model.stored_experts import StoredExperts, stored_experts


class Router(nn.Module):
    """The gate: logits [T, experts] = x W^T (+ b), replicated on every rank; kept in float
    (its few rows decide the routing, llama.cpp keeps them unquantized too)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights [T, k] in the logits' dtype, expert ids [T, k] int64): softmax over
    every expert in float32, its top k (torch.topk's order, ties included), renormalized
    to sum to 1 when `renormalize`; with `softmax_after_topk` (gpt-oss) the top k of the
    logits, then a softmax over those k."""
    if softmax_after_topk:
        logits, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(logits, dim=-1), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(order, counts) for expert ids [T, k]: `order` [k * T] lists the (slot, token) pairs,
    numbered slot * T + token, sorted by expert id; within an expert by slot, then token
    (the order in which transformers gathers an expert's rows); `counts[e]` how many pairs
    go to expert e."""
    flat = expert_ids.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer: router, then the chosen experts' gated MLPs.

    Each expert is a `GatedMLP` of the expert width (`experts.{e}`), so it loads, shards
    (rows of gate/up, columns of down across tensor-parallel ranks), packs and quantizes
    as a dense MLP does; under tensor parallelism the experts' partial sums are added
    locally and all-reduced once per layer.

    Qwen3-Next / Qwen3.5 add a `shared_expert` that every token runs, scaled by
    sigmoid(`shared_expert_gate`(x)) (one replicated row), to the routed experts' sum."""

    def __init__(self, config: ModelConfig, tp: TPContext, expert_factory, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.softmax_after_topk = config.softmax_after_topk
        self.gate = Router(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.experts = nn.ModuleList(expert_factory(config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(config.hidden_size, 1) if shared_expert is not None else None
        self.stored_experts: StoredExperts | None = None

    def use_stored_experts(self, enabled: bool) -> None:
        """Run the experts in one native call per step where they allow it (`stored_experts`);
        call after the experts' weights and kernel choices are final."""
        self.stored_experts = stored_experts(self.experts) if enabled else None

    def forward(self, x: torch.Tensor, num_draft_rows: int = 0) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Drafts do not change which kernel an expert's rows
        take (an expert's row count is that of its tokens, drafts or not)."""
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize, self.softmax_after_topk)
        if self.stored_experts is not None and self.stored_experts.takes(x):
            out = self.stored_experts(x, expert_ids, weights)
        else:
            out = self._experts_one_by_one(x, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial_forward(x)
        return self.tp.all_reduce(out)

    def _experts_one_by_one(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, expert by expert (any weight layout)."""
        order, counts = group_by_expert(expert_ids, self.num_experts)
        tokens = order % x.shape[0]
        flat_weights = weights.t().reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            rows = tokens[start:start + count]
            start += count
            y = expert.partial_forward(x.index_select(0, rows))
            out.index_add_(0, rows, y * flat_weights.index_select(0, pairs).unsqueeze(1))
        return out
