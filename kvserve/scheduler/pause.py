"""Pause states of the scheduler (the engine's pause modes map onto them)."""
from __future__ import annotations

import enum


class PauseState(enum.IntEnum):
    """UNPAUSED: normal. PAUSED_NEW: running (and preempted) requests go on,
    nothing new is admitted. PAUSED_ALL: nothing is scheduled and the
    scheduler reports no unfinished work, so the engine loop idles."""

    UNPAUSED = 0
    PAUSED_NEW = 1
    PAUSED_ALL = 2


# pause(mode) -> the state it enters; "abort" also finishes every request first.
PAUSE_MODES = {
    "abort": PauseState.PAUSED_NEW,
    "wait": PauseState.PAUSED_NEW,
    "keep": PauseState.PAUSED_ALL,
}
