"""Buffers reused from step to step for a step's largest short-lived intermediates.

A many-token step's gate and up projections and their gated product are each tens to hundreds
of MB (a 2,048-token prefill of a 1B model: 64 MiB apiece, every layer). Fresh, each is a new
mapping whose every page faults and is zeroed on first write: 1.4 million page faults in one
such prefill, about as long as the step's whole attention. Here a role's buffer is kept (one per
thread, grown to the largest step seen) and handed out again; its previous contents must be dead
by the next request for the same role, which holds for intermediates consumed within the layer
that made them. Steps below `MIN_ROWS` rows allocate as before (small buffers come from the
allocator's free lists without faults)."""
from __future__ import annotations

import threading

import torch

MIN_ROWS = 64

_local = threading.local()


def reusable(x: torch.Tensor) -> bool:
    """Whether x is float32 rows [rows, cols] of a step large enough for reused buffers."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] >= MIN_ROWS


def scratch_for(x: torch.Tensor, role: str | None, cols: int) -> torch.Tensor | None:
    """`scratch(role, rows of x, cols)` where a role is given and x is `reusable`, else None
    (the caller allocates as before)."""
    return scratch(role, x.shape[0], cols, torch.float32) if role is not None and reusable(x) else None


def scratch(role: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous [rows, cols] tensor of `dtype` for intermediate `role`, overwritten by the next
    request for the same role on this thread (contents undefined)."""
    buffers = _local.__dict__.setdefault("buffers", {})
    key, size = (role, dtype), rows * cols
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < size:
        buffers.pop(key, None)  # the old one freed before the larger one is mapped
        buffer = buffers[key] = torch.empty(size, dtype=dtype)
    return buffer[:size].view(rows, cols)
