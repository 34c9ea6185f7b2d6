"""Per-request logit processing that needs request state: `logit_bias` and grammar masks.

Applied to the raw logits before the sampler, so every sampling mode
(greedy, temperature, top-k/p, min-p, penalties, seeds) and the reported
logprobs see the constrained distribution. A request's grammar matcher lives
in its `RequestState`: it is created at the request's first sampled token
(advanced over the outputs it already has, so a request resumed after
preemption picks up where the scheduler's token list ends) and advanced only
on tokens this runner really sampled. Only the rank that samples ever builds
matchers.

The masks of a step are filled on a mask thread while that step's forward runs
(`start_masks` before the forward, `apply` after it): llguidance computes them
in Rust without the GIL, and the matchers already hold every token sampled
before this step, so only what the forward does not cover stays on the
critical path (`MaskStats.wait_s`).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.model.grammar import (FailedGrammar, GrammarCompiler, StructuredOutputError, compiler_for_model,
                                   disallowed_tokens, mask_logits_)
from kvserve.worker.input_batch import RequestState

logger = logging.getLogger(__name__)


@dataclass
class MaskStats:
    """Running totals of the grammar-mask work of one runner. `fill_s` is spent on the
    mask thread, alongside the forward; on the critical path remain `wait_s`, what the
    steps still waited for it after their forward, and `apply_s`, setting the logits."""

    steps: int = 0
    rows: int = 0  # one per constrained token position sampled or verified
    fill_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0


@dataclass
class PendingMasks:
    """The masks of one step being filled: `disallowed` resolves to [len(rows), vocab] bools."""

    disallowed: "Future[torch.Tensor]"
    rows: list[int]


class LogitsConstraints:
    """Applies `logit_bias` and structured-output masks for one runner."""

    def __init__(self, model_config) -> None:
        self.model_config = model_config
        self._compiler: GrammarCompiler | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        self.stats = MaskStats()

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = compiler_for_model(self.model_config)
        return self._compiler

    def start_masks(self, states: list[RequestState], drafts: list[list[int]] | None = None) -> PendingMasks | None:
        """Begin filling the step's grammar masks on the mask thread (None when no request
        is constrained), so that they are computed while the forward runs.

        The matchers are exact here: the previous step advanced them with its sampled
        tokens on this same step thread, and nothing touches them until `apply` waits.
        Rows are laid out as in `apply`.
        """
        constrained = [i for i, s in enumerate(states) if s.sampling_params.structured_outputs is not None]
        if not constrained:
            return None
        num_rows = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(states)
        first_rows = [sum(num_rows[:i]) for i in range(len(states))]
        rows = [first_rows[i] + j for i in constrained for j in range(num_rows[i])]
        constrained_drafts = [drafts[i] if drafts is not None else [] for i in constrained]
        if self._mask_thread is None:
            # One thread: a step's masks never overlap the next step's on the same matchers.
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-mask")
        future = self._mask_thread.submit(self._fill, [states[i] for i in constrained], constrained_drafts)
        return PendingMasks(future, rows)

    def apply(self, logits: torch.Tensor, states: list[RequestState],
              drafts: list[list[int]] | None = None, pending: PendingMasks | None = None) -> torch.Tensor:
        """The logits after each request's bias and grammar mask (unchanged when none has either).

        Without drafts, row i is request i. With drafts (speculative decoding), request i
        owns 1 + len(drafts[i]) consecutive rows, row j after its first j draft tokens.
        `pending` is this step's `start_masks` (started here when not given).
        """
        if any(s.sampling_params.logit_bias for s in states):
            num_rows = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(states)
            logits = self._add_bias(logits, states, [sum(num_rows[:i]) for i in range(len(states))], num_rows)
        if pending is None:
            pending = self.start_masks(states, drafts)
            if pending is None:
                return logits
        waited_from = time.perf_counter()
        disallowed = pending.disallowed.result()
        applied_from = time.perf_counter()
        logits = mask_logits_(logits, disallowed, pending.rows)
        self.stats.wait_s += applied_from - waited_from
        self.stats.apply_s += time.perf_counter() - applied_from
        return logits

    def _fill(self, states: list[RequestState], drafts: list[list[int]]) -> torch.Tensor:
        """On the mask thread: the unpacked masks of the constrained requests' rows (True: banned)."""
        started = time.perf_counter()
        matchers = [self._matcher(state) for state in states]
        if not any(drafts):
            bitmask = self.compiler.fill_bitmasks(matchers)
        else:
            bitmask = torch.cat([self.compiler.fill_bitmasks_along(m, d) for m, d in zip(matchers, drafts)])
        disallowed = disallowed_tokens(bitmask, self.compiler.vocab_size)
        self.stats.steps += 1
        self.stats.rows += disallowed.shape[0]
        self.stats.fill_s += time.perf_counter() - started
        return disallowed

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
