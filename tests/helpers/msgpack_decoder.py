"""A small MessagePack decoder written from the spec (github.com/msgpack/msgpack/blob/master/spec.md),
independent of any msgpack library, for checking wire formats in tests.

Covers nil, booleans, ints, floats, str, bin, arrays and maps (no ext types).
"""
from __future__ import annotations

import struct


class MsgpackDecoder:
    """Decodes one value from `data`; `decode()` checks nothing is left over."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def decode(self):
        value = self._value()
        if self.pos != len(self.data):
            raise ValueError(f"{len(self.data) - self.pos} trailing bytes")
        return value

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("truncated msgpack data")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def _uint(self, n: int) -> int:
        return int.from_bytes(self._take(n), "big", signed=False)

    def _int(self, n: int) -> int:
        return int.from_bytes(self._take(n), "big", signed=True)

    def _value(self):
        tag = self._take(1)[0]
        if tag <= 0x7F:
            return tag                                   # positive fixint
        if tag >= 0xE0:
            return tag - 0x100                           # negative fixint
        if 0x80 <= tag <= 0x8F:
            return self._map(tag & 0x0F)
        if 0x90 <= tag <= 0x9F:
            return self._array(tag & 0x0F)
        if 0xA0 <= tag <= 0xBF:
            return self._take(tag & 0x1F).decode("utf-8")
        simple = {0xC0: None, 0xC2: False, 0xC3: True}
        if tag in simple:
            return simple[tag]
        sized = {
            0xC4: lambda: self._take(self._uint(1)), 0xC5: lambda: self._take(self._uint(2)),
            0xC6: lambda: self._take(self._uint(4)),
            0xCA: lambda: struct.unpack(">f", self._take(4))[0], 0xCB: lambda: struct.unpack(">d", self._take(8))[0],
            0xCC: lambda: self._uint(1), 0xCD: lambda: self._uint(2), 0xCE: lambda: self._uint(4),
            0xCF: lambda: self._uint(8), 0xD0: lambda: self._int(1), 0xD1: lambda: self._int(2),
            0xD2: lambda: self._int(4), 0xD3: lambda: self._int(8),
            0xD9: lambda: self._take(self._uint(1)).decode("utf-8"),
            0xDA: lambda: self._take(self._uint(2)).decode("utf-8"),
            0xDB: lambda: self._take(self._uint(4)).decode("utf-8"),
            0xDC: lambda: self._array(self._uint(2)), 0xDD: lambda: self._array(self._uint(4)),
            0xDE: lambda: self._map(self._uint(2)), 0xDF: lambda: self._map(self._uint(4)),
        }
        if tag not in sized:
            raise ValueError(f"unsupported msgpack type byte 0x{tag:02x}")
        return sized[tag]()

    def _array(self, n: int) -> list:
        return [self._value() for _ in range(n)]

    def _map(self, n: int) -> dict:
        items = {}
        for _ in range(n):
            key = self._value()
            items[key] = self._value()
        return items


def decode_msgpack(data: bytes):
    """The value `data` encodes."""
    return MsgpackDecoder(data).decode()
