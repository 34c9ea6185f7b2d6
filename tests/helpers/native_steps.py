"""Counting the steps the native decoder ran (did not decline), for its tests."""
from __future__ import annotations

from kvserve.model import native_decoder


def count_native_steps(monkeypatch) -> list[int]:
    """Wrap `NativeDecoder.forward` for the test; the returned one-element list holds the count."""
    count = [0]
    forward = native_decoder.NativeDecoder.forward

    def counting(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        count[0] += out is not None
        return out
    monkeypatch.setattr(native_decoder.NativeDecoder, "forward", counting)
    return count


def record_step_sizes(monkeypatch) -> list[int]:
    """Wrap `NativeDecoder.forward` for the test; the returned list gets the token count of
    every step it ran (did not decline)."""
    sizes: list[int] = []
    forward = native_decoder.NativeDecoder.forward

    def recording(self, hidden, *args, **kwargs):
        out = forward(self, hidden, *args, **kwargs)
        if out is not None:
            sizes.append(hidden.shape[0])
        return out
    monkeypatch.setattr(native_decoder.NativeDecoder, "forward", recording)
    return sizes
