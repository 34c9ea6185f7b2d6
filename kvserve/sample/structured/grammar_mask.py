"""Setting the logits a grammar bans to -inf, from its packed allowed-token bitmask.

A grammar engine fills one int32 bitmask row per constrained logits row (token
t is bit t % 32 of word t / 32, little-endian). On CPU float32 logits the native
kernel (csrc/grammar/grammar_mask.c) reads those words as they are and writes -inf in
place: a few microseconds per 49k-token row. The torch path (CUDA, no C
compiler, `KVSERVE_CPU_KERNELS=0` or `KVSERVE_GRAMMAR_MASK_ISA=torch`) unpacks
the words into one bool per token (`disallowed_tokens`, done on the mask thread
ahead of time) and runs `masked_fill_`; it is also the tests' reference.

Tokens past the bitmask's vocabulary (logits wider than the grammar's) are
banned; bits past the logits' width are ignored.

Where the native decoder runs the LM head (`kvserve.model.native_decoder`), a
`HeadMask` hands it the step's bitmask before the mask thread has filled it:
the head waits for the fill's ready flag (`publish_ready`), masks each logits
row while it is still in its cache, and skips computing the vocabulary words
no row may pick. A cold 49k-float row costs tens of microseconds to mask after
the forward; inside the head the work is a few, and at batch one most words of
a JSON grammar's structural positions are not computed at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.native.config import GRAMMAR_MASK_TORCH, KernelConfig
from kvserve.native import cpu_kernels, dispatch
from kvserve.native import isa as isa_table

ISA_CODES = isa_table.ISA_CODES  # the kernel's codes, narrowest first


def isa_available(isa: str) -> bool:
    """Whether this build and CPU run the kernel path `isa` ("portable", "avx2", "avx512")."""
    return dispatch.available("mask", isa)


def choose_mask_isa(kernel_config: KernelConfig, device: torch.device | str) -> str | None:
    """The kernel path a runner on `device` masks with (the widest this CPU runs, capped by
    `kernel_config.grammar_mask_isa`), or None for the torch path."""
    cap = kernel_config.grammar_mask_isa
    if torch.device(device).type != "cpu" or not kernel_config.cpu_kernels or cap == GRAMMAR_MASK_TORCH:
        return None
    return dispatch.widest("mask", cap)


def kernel_takes(logits: torch.Tensor) -> bool:
    """The native kernel can mask these logits in place as they are (CPU ones, see `choose_mask_isa`)."""
    return logits.dtype is torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1


@dataclass(frozen=True)
class KernelMasks:
    """Bitmask rows laid out for the kernel: row j of `bitmask` masks logits row `rows[j]`.
    Built off the critical path (on the mask thread), so applying them after the forward
    is a single native call."""

    bitmask: torch.Tensor
    rows: list[int]
    isa: str
    row_index: np.ndarray | None  # rows as int64 (None: they are 0, 1, ...), kept alive for the call
    rows_needed: int  # the logits must have at least this many rows
    call_args: tuple[int, ...]  # the kernel's arguments after the logits'


def kernel_masks(bitmask: torch.Tensor, rows: list[int], isa: str) -> KernelMasks:
    """`bitmask` (int32 [len(rows), words] on the CPU, contiguous rows) prepared for `apply_kernel_masks_`."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(-1) != 1 or bitmask.device.type != "cpu":
        raise ValueError("the bitmask must be a CPU int32 [rows, words] tensor with contiguous rows")
    if bitmask.shape[0] != len(rows):
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {len(rows)} logits rows")
    if rows and min(rows) < 0:
        raise ValueError(f"negative logits row in {rows}")
    row_index = None if rows == list(range(len(rows))) else np.asarray(rows, dtype=np.int64)
    call_args = (bitmask.data_ptr(), bitmask.stride(0), bitmask.shape[1],
                 None if row_index is None else row_index.ctypes.data, len(rows), ISA_CODES[isa])
    return KernelMasks(bitmask, list(rows), isa, row_index, max(rows, default=-1) + 1, call_args)


def apply_kernel_masks_(logits: torch.Tensor, masks: KernelMasks) -> torch.Tensor:
    """Bans, in place, the tokens whose bit is 0 (the logits must pass `kernel_takes`)."""
    if masks.rows_needed > logits.shape[0]:
        raise ValueError(f"logits rows {masks.rows} out of range for {logits.shape[0]} rows")
    code = cpu_kernels.load_library().kvserve_apply_token_bitmask(logits.data_ptr(), logits.stride(0),
                                                                  logits.shape[1], *masks.call_args)
    if code:
        raise cpu_kernels.KernelArgumentError(f"the grammar-mask kernel has no {masks.isa} path on this CPU")
    return logits


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], isa: str) -> torch.Tensor:
    """Bans, in place, the tokens whose bit is 0: row j of `bitmask` masks logits row
    `rows[j]`, on the kernel path `isa` (the logits must pass `kernel_takes`)."""
    return apply_kernel_masks_(logits, kernel_masks(bitmask, rows, isa))


@dataclass
class HeadMask:
    """A step's grammar bitmask handed to the model's LM head before it is filled.

    The mask thread fills `bitmask` (int32 [len(rows), words], contiguous rows; row j
    masks logits row `rows[j]`) and then publishes through `ready` (int32 [1], see
    `publish_ready`): `ready_value`, this step's number, when filled, its negation when
    there is no mask. A model whose LM head applied it sets the outputs: `applied`, the
    seconds its head waited for the fill (`wait_s`) and spent writing -inf (`mask_s`);
    otherwise the logits come back unmasked."""

    bitmask: torch.Tensor
    rows: list[int]
    ready: torch.Tensor
    isa: str
    ready_value: int = 1
    applied: bool = False
    wait_s: float = 0.0
    mask_s: float = 0.0

    @classmethod
    def empty(cls, rows: list[int], vocab_size: int, isa: str) -> "HeadMask":
        """An unfilled mask of `rows` for a vocabulary of `vocab_size` tokens, with buffers of its own."""
        bitmask = torch.zeros((len(rows), (vocab_size + 31) // 32), dtype=torch.int32)
        return cls(bitmask, list(rows), torch.zeros(1, dtype=torch.int32), isa)


def publish_ready(head_mask: HeadMask, filled: bool) -> None:
    """On the filling thread, after its last write to the bitmask: the step's number (or its
    negation when there is no mask) becomes visible to the head only after those writes."""
    value = head_mask.ready_value if filled else -head_mask.ready_value
    cpu_kernels.load_library().kvserve_publish_mask_ready(head_mask.ready.data_ptr(), value)


class HeadMaskPool:
    """The `HeadMask`s of successive steps, on one reused bitmask buffer and ready flag, so a
    step allocates nothing before its forward (the allocations cost tens of microseconds
    there, with the caches cold). Each step gets its own number to publish: a late fill of
    an earlier step (one whose step failed) can never pass for a later one's, and the one
    mask thread fills the steps in order, so it has finished writing before the next fill."""

    def __init__(self, vocab_size: int, isa: str) -> None:
        self.isa = isa
        self._words = (vocab_size + 31) // 32
        self._ready = torch.zeros(1, dtype=torch.int32)
        self._buffer = torch.zeros((0, self._words), dtype=torch.int32)
        self._views: dict[int, torch.Tensor] = {}  # by row count: the first rows of the buffer
        self._step = 0

    def next(self, rows: list[int]) -> HeadMask:
        """The next step's mask for `rows`."""
        view = self._views.get(len(rows))
        if view is None:
            if len(rows) > self._buffer.shape[0]:  # masks handed out before keep the old buffer alive
                self._buffer = torch.zeros((max(len(rows), 2 * self._buffer.shape[0]), self._words), dtype=torch.int32)
                self._views = {}
            view = self._views[len(rows)] = self._buffer[:len(rows)]
        self._step = self._step % (2**31 - 2) + 1
        return HeadMask(view, rows, self._ready, self.isa, ready_value=self._step)


def disallowed_tokens(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] bool: True where token t's bit in its row of `bitmask` is 0 (tokens
    past the bitmask's vocabulary are disallowed)."""
    # Little-endian int32 words: bit k of word w is bit k % 8 of byte 4 * w + k // 8.
    # Inverting the words first leaves one numpy pass over the vocabulary.
    banned_bits = np.invert(bitmask.numpy()).view(np.uint8)
    disallowed = torch.from_numpy(np.unpackbits(banned_bits, axis=1, bitorder="little")[:, :width].view(np.bool_))
    if disallowed.shape[1] < width:
        disallowed = torch.nn.functional.pad(disallowed, (0, width - disallowed.shape[1]), value=True)
    return disallowed


def mask_logits_(logits: torch.Tensor, disallowed: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Set the `disallowed` tokens (one bool row per entry of `rows`) of `logits` to -inf, in place."""
    width = logits.shape[-1]
    if disallowed.shape[1] != width:
        disallowed = torch.nn.functional.pad(disallowed[:, :width], (0, max(0, width - disallowed.shape[1])),
                                             value=True)
    disallowed = disallowed.to(logits.device, non_blocking=True)
    if rows == list(range(logits.shape[0])):
        return logits.masked_fill_(disallowed, float("-inf"))
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of `logits` with every token whose bit is 0 set to -inf, in the given rows (torch path)."""
    return mask_logits_(logits.clone(), disallowed_tokens(bitmask, logits.shape[-1]), rows)
