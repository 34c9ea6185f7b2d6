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

    def apply(self, logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
        """The logits of rows `states` after their bias and grammar mask (unchanged when none has either)."""
        biased = [(row, s.sampling_params.logit_bias) for row, s in enumerate(states) if s.sampling_params.logit_bias]
        if biased:
            logits = logits.clone()
            for row, bias in biased:
                ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
                values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
                logits[row].index_add_(0, ids, values)
        constrained = [row for row, s in enumerate(states) if s.sampling_params.structured_outputs is not None]
        if not constrained:
            return logits
        matchers = [self._matcher(states[row]) for row in constrained]
        return apply_bitmask(logits, self.compiler.fill_bitmasks(matchers), constrained)

    def advance(self, states: list[RequestState], token_ids: list[int]) -> None:
        """Feed each constrained request the token just sampled for it."""
        for state, token_id in zip(states, token_ids):
            if state.grammar is not None:
                state.grammar.consume_token(int(token_id))

    def _matcher(self, state: RequestState):
        if state.grammar is None:
            try:
                state.grammar = self.compiler.new_matcher(state.sampling_params.structured_outputs,
                                                          state.output_token_ids)
            except StructuredOutputError as exc:  # front-ends check first; never fail the step
                logger.warning("request %s: %s; it can only end", state.req_id, exc)
                state.grammar = FailedGrammar(str(exc))
        return state.grammar
