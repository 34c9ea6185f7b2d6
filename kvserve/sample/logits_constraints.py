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
(`start_masks` before the forward, `apply` after it): the mask thread first
feeds each matcher the tokens sampled since (`advance` only queues them in the
request's `grammar_backlog`), then llguidance computes the masks in Rust
without the GIL, so only what the forward does not cover stays on the critical
path (`MaskStats`). On CPU the native kernel of
`kvserve.sample.structured.grammar_mask` then writes -inf straight from the packed
bitmask; on the torch path the mask thread also unpacks the bitmask into one
bool per token, for `masked_fill_`.

On CPU the step's bitmask is also handed to the model (`PendingMasks.head_mask`)
before it is filled: where the native decoder runs the LM head, the head waits
for the fill and writes the -inf itself while the logits are in its cache (and
skips the vocabulary rows no request may pick), so `apply` has nothing left to
do; elsewhere the logits come back unmasked and `apply` masks them as above.

Whatever the timing, a constrained request never keeps a token its grammar bans: after
sampling, the runner checks each constrained row's token against that step's bitmask
(`outside_masks`, one bit per row). A ban there means a mask was missed; the row is then
masked after the forward (`mask_again`), sampled again and the miss logged. Tests make
every fill late with `KVSERVE_TEST_GRAMMAR_FILL_DELAY_MS` (and the head's wait short with
`KVSERVE_TEST_GRAMMAR_HEAD_WAIT_MS`, see `kvserve.model.native_decoder`).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from kvserve.native.config import KernelConfig
from kvserve.sampling_params import SamplingParams
from kvserve.sample.structured.grammar import FailedGrammar, GrammarCompiler, StructuredOutputError, compiler_for_model
from kvserve.sample.structured.grammar_mask import (HeadMask, HeadMaskPool, KernelMasks, apply_kernel_masks_, choose_mask_isa,
                                                    disallowed_tokens, kernel_masks, kernel_takes, mask_logits_, publish_ready)

logger = logging.getLogger(__name__)

# Tests only: the mask thread sleeps this long before each fill, so every fill is late.
FILL_DELAY_ENV = "KVSERVE_TEST_GRAMMAR_FILL_DELAY_MS"


def _fill_delay_s() -> float:
    return float(os.environ.get(FILL_DELAY_ENV) or 0) / 1000


class RequestState(Protocol):
    """What the constraints read and keep of one request between steps (the runner's
    `kvserve.worker.input_batch.RequestState` has these fields)."""

    req_id: str
    sampling_params: SamplingParams
    output_token_ids: list[int]
    grammar: Any  # the request's matcher, created at its first constrained step
    grammar_backlog: list[int]  # tokens sampled since the matcher last advanced


@dataclass
class MaskStats:
    """Running totals of the grammar-mask work of one runner. `fill_s` is spent on the
    mask thread, alongside the forward; on the critical path remain `start_s`, handing
    the fill to the mask thread before the forward, `wait_s`, what the steps still waited
    for it (inside the LM head or after the forward), `apply_s`, setting the logits, and
    `advance_s`, queueing the sampled tokens for the matchers (the mask thread feeds
    them in, as part of `fill_s`)."""

    steps: int = 0
    rows: int = 0  # one per constrained token position sampled or verified
    head_rows: int = 0  # of those, the rows the LM head masked itself (inside the native decoder)
    fill_s: float = 0.0
    start_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0
    advance_s: float = 0.0
    missed_rows: int = 0  # rows sampled outside a mask that was not applied, then sampled again

    @property
    def critical_path_s(self) -> float:
        """The mask work the steps did not hide behind their forward."""
        return self.start_s + self.wait_s + self.apply_s + self.advance_s


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
    where every bit of Python costs (the forward has evicted it from the caches).
    `head_mask` (CPU kernel path only) is the bitmask being filled, for the model's LM head."""

    def __init__(self, rows: list[int], head_mask: HeadMask | None = None) -> None:
        self.rows = rows
        self.head_mask = head_mask
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


class _MaskThread:
    """The one thread that fills masks, in the order the steps hand them over: a step's masks
    never overlap the next step's on the same matchers. Handing a fill over is one queue put
    (a thread pool's `submit` costs several times more on the step's critical path)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kvserve-mask_0", daemon=True).start()

    def submit(self, fn, *args) -> None:
        self._jobs.put((fn, args))

    def _run(self) -> None:
        while True:
            fn, args = self._jobs.get()
            fn(*args)  # _fill_into hands every exception to the step thread


class LogitsConstraints:
    """Applies `logit_bias` and structured-output masks for one runner."""

    def __init__(self, model_config, load_tokenizer: Callable[[Any], Any], device: torch.device | str = "cpu",
                 kernel_config: KernelConfig | None = None) -> None:
        self.model_config = model_config
        self._load_tokenizer = load_tokenizer
        self._device = device
        self._kernel_config = kernel_config or KernelConfig()
        self._mask_isa: str | None | bool = False  # False: not chosen yet
        self._compiler: GrammarCompiler | None = None
        self._mask_thread: _MaskThread | None = None
        self._head_masks: HeadMaskPool | None = None
        self._fill_delay_s = _fill_delay_s()
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
            self._compiler = compiler_for_model(self.model_config, self._load_tokenizer)
        return self._compiler

    def start_masks(self, states: list[RequestState], drafts: list[list[int]] | None = None) -> PendingMasks | None:
        """Begin filling the step's grammar masks on the mask thread (None when no request
        is constrained), so that they are computed while the forward runs.

        The matchers are exact there: the previous step handed its sampled tokens over
        (`advance`) on this same step thread, the mask thread feeds them to the matchers
        first, and nothing else touches the matchers or backlogs until `apply` waits.
        Rows are laid out as in `apply`.
        """
        constrained = [i for i, s in enumerate(states) if s.sampling_params.structured_outputs is not None]
        if not constrained:
            return None
        started = time.perf_counter()
        num_rows = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(states)
        first_rows = [sum(num_rows[:i]) for i in range(len(states))]
        rows = [first_rows[i] + j for i in constrained for j in range(num_rows[i])]
        constrained_drafts = [drafts[i] if drafts is not None else [] for i in constrained]
        if self._mask_thread is None:
            self._mask_thread = _MaskThread()
        head_mask = None
        if self.mask_isa is not None:
            if self._head_masks is None:
                self._head_masks = HeadMaskPool(self.compiler.vocab_size, self.mask_isa)
            head_mask = self._head_masks.next(rows)
        pending = PendingMasks(rows, head_mask)
        self._mask_thread.submit(self._fill_into, pending, [states[i] for i in constrained], constrained_drafts)
        self.stats.start_s += time.perf_counter() - started
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
        head = pending.head_mask
        if head is not None and head.applied:
            # The fill published its masks before the head used them: nothing to wait for.
            self.stats.head_rows += len(pending.rows)
            self.stats.wait_s += head.wait_s
            self.stats.apply_s += head.mask_s + time.perf_counter() - waited_from
            return logits
        masks = pending.result()
        applied_from = time.perf_counter()
        logits = self._mask_after_forward(logits, pending.rows, masks)
        self.stats.wait_s += applied_from - waited_from + (0.0 if head is None else head.wait_s)
        self.stats.apply_s += time.perf_counter() - applied_from
        return logits

    def outside_masks(self, pending: PendingMasks | None, token_ids: list[list[int]],
                      first_rows: list[int] | None = None) -> list[int]:
        """The logits rows whose sampled token their grammar mask bans: none, unless a mask was
        missed. `token_ids[i]` holds the tokens sampled for request i, the j-th from logits row
        `first_rows[i] + j` (row i when `first_rows` is None). Waits for the step's fill."""
        if pending is None:
            return []
        bits = pending.result().bitmask.numpy()
        mask_row = {row: j for j, row in enumerate(pending.rows)}
        starts = range(len(token_ids)) if first_rows is None else first_rows
        banned = []
        for start, tokens in zip(starts, token_ids):
            for offset, token_id in enumerate(tokens):
                j = mask_row.get(start + offset)
                if j is not None and not _allows(bits[j], int(token_id)):
                    banned.append(start + offset)
        return banned

    def mask_again(self, logits: torch.Tensor, pending: PendingMasks, banned_rows: list[int]) -> torch.Tensor:
        """The step's masks applied once more, after the forward, to logits some of whose rows
        (`banned_rows`) gave a token their mask bans: the miss is logged."""
        head = pending.head_mask
        logger.error("grammar mask missed on logits rows %s (masked in the LM head: %s); masked again and "
                     "sampled again", banned_rows, None if head is None else head.applied)
        self.stats.missed_rows += len(banned_rows)
        return self._mask_after_forward(logits, pending.rows, pending.result())

    def _mask_after_forward(self, logits: torch.Tensor, rows: list[int], masks: StepMasks) -> torch.Tensor:
        if self.mask_isa is not None and kernel_takes(logits):
            return apply_kernel_masks_(logits, masks.kernel or kernel_masks(masks.bitmask, rows, self.mask_isa))
        disallowed = masks.disallowed
        if disallowed is None:
            disallowed = disallowed_tokens(masks.bitmask, self.compiler.vocab_size)
        return mask_logits_(logits, disallowed, rows)

    def _fill_into(self, pending: PendingMasks, states: list[RequestState], drafts: list[list[int]]) -> None:
        head = pending.head_mask
        if self._fill_delay_s:
            time.sleep(self._fill_delay_s)
        try:
            with torch.inference_mode():  # the step thread made `head.bitmask` in inference mode
                masks = self._fill(states, drafts, pending.rows, None if head is None else head.bitmask)
        except BaseException as exc:  # handed to the step thread, which raises it
            if head is not None:
                publish_ready(head, filled=False)
            pending.set(None, exc)
            return
        if head is not None:
            publish_ready(head, filled=True)
        pending.set(masks)

    def _fill(self, states: list[RequestState], drafts: list[list[int]], rows: list[int],
              out: torch.Tensor | None) -> StepMasks:
        """On the mask thread: the masks of the constrained requests' rows (into `out` when given)."""
        started = time.perf_counter()
        matchers = [self._matcher(state) for state in states]
        if not any(drafts):
            bitmask = self.compiler.fill_bitmasks(matchers, out)
        else:
            bitmask = torch.cat([self.compiler.fill_bitmasks_along(m, d) for m, d in zip(matchers, drafts)],
                                out=out)
        masks = StepMasks(bitmask)
        if self.mask_isa is not None:
            if out is None:  # else the LM head is likely to mask, and `apply` lays them out if not
                masks.kernel = kernel_masks(bitmask, rows, self.mask_isa)
        else:
            masks.disallowed = disallowed_tokens(bitmask, self.compiler.vocab_size)
        self.stats.steps += 1
        self.stats.rows += bitmask.shape[0]
        self.stats.fill_s += time.perf_counter() - started
        return masks

    def advance(self, states: list[RequestState], token_ids: list[list[int]]) -> None:
        """Hand each constrained request the tokens this step really produced for it: its
        matcher consumes them on the mask thread, before it fills that request's next mask."""
        started = time.perf_counter()
        constrained = False
        for state, tokens in zip(states, token_ids):
            if state.grammar is not None:
                constrained = True
                state.grammar_backlog.extend(int(token_id) for token_id in tokens)
        if constrained:
            self.stats.advance_s += time.perf_counter() - started

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
        """On the mask thread: the request's matcher, advanced over every token sampled so far."""
        if state.grammar is None:
            state.grammar_backlog.clear()  # the new matcher consumes all of output_token_ids
            try:
                state.grammar = self.compiler.new_matcher(state.sampling_params.structured_outputs,
                                                          state.output_token_ids)
            except StructuredOutputError as exc:  # front-ends check first; never fail the step
                logger.warning("request %s: %s; it can only end", state.req_id, exc)
                state.grammar = FailedGrammar(str(exc))
        for token_id in state.grammar_backlog:
            was_healthy = not state.grammar.is_error()
            if not state.grammar.consume_token(token_id) and was_healthy:
                # A token sampled outside its mask: from here the request can only end (EOS).
                logger.warning("request %s: sampled token %d does not fit its grammar: %s", state.req_id,
                               token_id, state.grammar.get_error())
        state.grammar_backlog.clear()
        return state.grammar


def _allows(words, token_id: int) -> bool:
    """Whether a bitmask row (int32 words; bit t % 32 of word t / 32) allows `token_id`."""
    return 0 <= token_id < 32 * len(words) and (int(words[token_id >> 5]) >> (token_id & 31)) & 1 == 1
