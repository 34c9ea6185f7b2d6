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
