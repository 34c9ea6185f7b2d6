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
critical path (`MaskStats.wait_s`). On CPU the native kernel of
`kvserve.model.grammar_mask` then writes -inf straight from the packed
bitmask; on the torch path the mask thread also unpacks the bitmask into one
bool per token, for `masked_fill_`.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvserve.config import KernelConfig
from kvserve.model.grammar import FailedGrammar, GrammarCompiler, StructuredOutputError, compiler_for_model
from kvserve.model.grammar_mask import (KernelMasks, apply_kernel_masks_, choose_mask_isa, disallowed_tokens,
                                        kernel_masks, kernel_takes, mask_logits_)
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
class StepMasks:
    """The grammar masks of one step's constrained rows: the packed allowed-token bits
    (int32 [rows, ceil(vocab / 32)]) and, ready for the path the runner masks with, either
    the kernel's layout of them or the banned tokens unpacked ([rows, vocab] bool)."""

    bitmask: torch.Tensor
    kernel: KernelMasks | None = None
    disallowed: torch.Tensor | None = None


class PendingMasks:
    """The masks of one step being filled on the mask thread; row j of them belongs to
    logits row `rows[j]`. `result()` waits on a plain lock: it runs right after the forward,
    where every bit of Python costs (the forward has evicted it from the caches)."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows
        self._filled = threading.Lock()
        self._filled.acquire()
        self._masks: StepMasks | None = None
        self._error: BaseException | None = None

    def set(self, masks: StepMasks | None, error: BaseException | None = None) -> None:
        """On the mask thread: the step's masks (or why there are none) are ready."""
        self._masks, self._error = masks, error
        self._filled.release()

    def result(self) -> StepMasks:
        """The step's masks, once filled (raises what the fill raised)."""
        self._filled.acquire()
        self._filled.release()
        if self._error is not None:
            raise self._error
        return self._masks


class LogitsConstraints:
    """Applies `logit_bias` and structured-output masks for one runner."""

    def __init__(self, model_config, device: torch.device | str = "cpu",
                 kernel_config: KernelConfig | None = None) -> None:
        self.model_config = model_config
        self._device = device
        self._kernel_config = kernel_config or KernelConfig()
        self._mask_isa: str | None | bool = False  # False: not chosen yet
        self._compiler: GrammarCompiler | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        self.stats = MaskStats()

    @property
    def mask_isa(self) -> str | None:
        """The grammar-mask kernel's path (None: the torch path), chosen at the first constrained step."""
        if self._mask_isa is False:
            self._mask_isa = choose_mask_isa(self._kernel_config, self._device)
        return self._mask_isa

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
        pending = PendingMasks(rows)
        self._mask_thread.submit(self._fill_into, pending, [states[i] for i in constrained], constrained_drafts)
        return pending

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
        masks = pending.result()
        applied_from = time.perf_counter()
        if masks.kernel is not None and kernel_takes(logits):
            logits = apply_kernel_masks_(logits, masks.kernel)
        else:
            disallowed = masks.disallowed
            if disallowed is None:
                disallowed = disallowed_tokens(masks.bitmask, self.compiler.vocab_size)
            logits = mask_logits_(logits, disallowed, pending.rows)
        self.stats.wait_s += applied_from - waited_from
        self.stats.apply_s += time.perf_counter() - applied_from
        return logits

    def _fill_into(self, pending: PendingMasks, states: list[RequestState], drafts: list[list[int]]) -> None:
        try:
            pending.set(self._fill(states, drafts, pending.rows))
        except BaseException as exc:  # handed to the step thread, which raises it
            pending.set(None, exc)

    def _fill(self, states: list[RequestState], drafts: list[list[int]], rows: list[int]) -> StepMasks:
        """On the mask thread: the masks of the constrained requests' rows."""
        started = time.perf_counter()
        matchers = [self._matcher(state) for state in states]
        if not any(drafts):
            bitmask = self.compiler.fill_bitmasks(matchers)
        else:
            bitmask = torch.cat([self.compiler.fill_bitmasks_along(m, d) for m, d in zip(matchers, drafts)])
        masks = StepMasks(bitmask)
        if self.mask_isa is not None:
            masks.kernel = kernel_masks(bitmask, rows, self.mask_isa)
        else:
            masks.disallowed = disallowed_tokens(bitmask, self.compiler.vocab_size)
        self.stats.steps += 1
        self.stats.rows += bitmask.shape[0]
        self.stats.fill_s += time.perf_counter() - started
        return masks

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
