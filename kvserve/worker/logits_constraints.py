"""Per-request logit processing that needs request state: `logit_bias` and grammar masks.

Applied to the raw logits before the sampler, so every sampling mode
(greedy, temperature, top-k/p, min-p, penalties, seeds) and the reported
logprobs see the constrained distribution. A request's grammar matcher lives
in its `RequestState`: it is created at the request's first sampled token
(advanced over the outputs it already has, so a request resumed after
preemption picks up where the scheduler's token list ends) and advanced only
on tokens this runner really sampled. Only the rank that samples ever builds
matchers.
"""
from __future__ import annotations

import logging

import torch

from kvserve.model.grammar import (FailedGrammar, GrammarCompiler, StructuredOutputError, apply_bitmask,
                                   compiler_for_model)
from kvserve.worker.input_batch import RequestState

logger = logging.getLogger(__name__)


class LogitsConstraints:
    """Applies `logit_bias` and structured-output masks for one runner."""

    def __init__(self, model_config) -> None:
        self.model_config = model_config
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = compiler_for_model(self.model_config)
        return self._compiler

    def apply(self, logits: torch.Tensor, states: list[RequestState],
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        """The logits after each request's bias and grammar mask (unchanged when none has either).

        Without drafts, row i is request i. With drafts (speculative decoding), request i
        owns 1 + len(drafts[i]) consecutive rows, row j after its first j draft tokens.
        """
        num_rows = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(states)
        first_rows = [sum(num_rows[:i]) for i in range(len(states))]
        if any(s.sampling_params.logit_bias for s in states):
            logits = self._add_bias(logits, states, first_rows, num_rows)
        constrained = [i for i, s in enumerate(states) if s.sampling_params.structured_outputs is not None]
        if not constrained:
            return logits
        matchers = [self._matcher(states[i]) for i in constrained]
        if drafts is None or not any(drafts[i] for i in constrained):
            bitmask = self.compiler.fill_bitmasks(matchers)
            return apply_bitmask(logits, bitmask, [first_rows[i] for i in constrained])
        rows = [first_rows[i] + j for i in constrained for j in range(num_rows[i])]
        bitmask = torch.cat([self.compiler.fill_bitmasks_along(m, drafts[i]) for i, m in zip(constrained, matchers)])
        return apply_bitmask(logits, bitmask, rows)

    def advance(self, states: list[RequestState], token_ids: list[list[int]]) -> None:
        """Feed each constrained request the tokens this step really produced for it."""
        for state, tokens in zip(states, token_ids):
            if state.grammar is not None:
                for token_id in tokens:
                    state.grammar.consume_token(int(token_id))

    @staticmethod
    def _add_bias(logits: torch.Tensor, states: list[RequestState], first_rows: list[int],
                  num_rows: list[int]) -> torch.Tensor:
        logits = logits.clone()
        for state, first, count in zip(states, first_rows, num_rows):
            bias = state.sampling_params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
                values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
                logits[first:first + count, ids] += values
        return logits

    def _matcher(self, state: RequestState):
        if state.grammar is None:
            try:
                state.grammar = self.compiler.new_matcher(state.sampling_params.structured_outputs,
                                                          state.output_token_ids)
            except StructuredOutputError as exc:  # front-ends check first; never fail the step
                logger.warning("request %s: %s; it can only end", state.req_id, exc)
                state.grammar = FailedGrammar(str(exc))
        return state.grammar
