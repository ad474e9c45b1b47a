"""The fast path's field encodings and the bounds-checked body reader, shared by every body codec.

protocol.py (frames and the hot operations' bodies) and spare_bodies.py (SPARE, STORE) build bodies from these
fields and read them with `Reader`, which checks every length against what is left of the frame before it
allocates anything: `ns` = u16 length + UTF-8; `keys` = u32 n | u8 k | the keys back to back when every key is
k bytes long, else u32 n | 0 | u8 length[n] | the keys; arrays of u64 little-endian.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Sequence

import numpy as np

__all__ = ["FrameError", "Reader", "ns_field", "keys_field", "u64s_field", "U32", "U64"]

U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")


class FrameError(ValueError):
    """A frame that breaks the format; the connection it came on must be closed."""


class Reader:
    """Walks a body, checking every length against what is left."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(buf)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise FrameError(f"frame ends {self.pos + n - len(self.buf)} bytes early")
        out = self.buf[self.pos: self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(U64.unpack(self.take(8))[0])

    def u64s(self, n: int) -> list[int]:
        return self.take(n * 8).cast("Q").tolist()

    def u8s(self, n: int) -> list[int]:
        return self.take(n).tolist()

    def namespace(self) -> str:
        n = int.from_bytes(self.take(2), "little")
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError:
            raise FrameError("namespace is not UTF-8") from None

    def keys(self) -> list[bytes]:
        n = self.u32()
        k = self.take(1)[0]
        if k:
            if n * k > len(self.buf) - self.pos:
                raise FrameError(f"{n} keys of {k} bytes in a frame with {len(self.buf) - self.pos} left")
            return list(_fixed(k, n).unpack(self.take(n * k)))
        if n > len(self.buf):  # each length is a byte: a count past the frame is a lie
            raise FrameError(f"{n} keys in a frame of {len(self.buf)} bytes")
        lengths = self.take(n).tolist()
        data = bytes(self.take(sum(lengths)))
        out, pos = [], 0
        for length in lengths:
            out.append(data[pos: pos + length])
            pos += length
        return out

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise FrameError(f"{len(self.buf) - self.pos} bytes left over after the body")


def ns_field(name: str) -> bytes:
    raw = name.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise FrameError(f"namespace of {len(raw)} bytes")
    return len(raw).to_bytes(2, "little") + raw


@functools.lru_cache(maxsize=256)
def _fixed(k: int, n: int) -> struct.Struct:
    """Splits n keys of k bytes in one C call (a Python slice loop costs ~0.1 us a key)."""
    return struct.Struct(f"{k}s" * n)


def keys_field(keys: Sequence[bytes]) -> bytes:
    try:
        lengths = bytes(map(len, keys))
    except ValueError:
        raise FrameError("a key longer than 255 bytes") from None
    n = len(lengths)
    if n and lengths[0] and lengths.count(lengths[0]) == n:
        return U32.pack(n) + lengths[:1] + b"".join(keys)
    return U32.pack(n) + b"\0" + lengths + b"".join(keys)


def u64s_field(values: Sequence[int] | np.ndarray) -> bytes:
    if isinstance(values, np.ndarray):
        return values.astype(np.uint64, copy=False).tobytes()
    return array("Q", values).tobytes()
