"""The bodies of SPARE and STORE: a connection's arena slots held ahead of its puts (kvstore/engine/spares.py).

A put through Reserve and Commit is two round trips; with spare slots it is a copy and one STORE::

    SPARE    req  u64 size | u32 count                 the connection's spare slots replaced by `count`
                                                       slots for blocks of `size` bytes
             rep  u32 slot_bytes | u32 n | u64 offsets[n]     n is count or 0 (the limits, or nothing
                  evictable: the client then puts the Reserve way); the slots held before are gone either way
    STORE    req  ns keys | u64 sizes[n] | u64 offsets[n]    block i was copied into spare slot offsets[i]
             rep  u32 stored | u32 n | u8 outcomes[n] | u64 refill[n]   outcomes as RESERVE's (RESERVED: stored
                  now; ALREADY_PRESENT / IN_FLIGHT: not stored, its slot stays spare); refill[i] a new spare slot
                  of the same size for each one used (0: none)

Slots belong to the connection they were granted on; another connection naming them is refused. Frames are
read with wire.py's Reader: every length is checked against the frame before anything is allocated.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvstore.fastpath.wire import FrameError, Reader, keys_field, ns_field, u64s_field

__all__ = ["encode_spare", "decode_spare", "encode_spare_reply", "decode_spare_reply", "encode_store",
           "decode_store", "encode_store_reply", "decode_store_reply"]

_SPARE = struct.Struct("<QI")
_U32X2 = struct.Struct("<II")


def encode_spare(size: int, count: int) -> bytes:
    return _SPARE.pack(size, count)


def decode_spare(body: bytes | memoryview) -> tuple[int, int]:
    r = Reader(body)
    size, count = _SPARE.unpack(r.take(_SPARE.size))
    r.done()
    return int(size), int(count)


def encode_spare_reply(slot_bytes: int, offsets: Sequence[int]) -> bytes:
    return _U32X2.pack(slot_bytes, len(offsets)) + u64s_field(offsets)


def decode_spare_reply(body: bytes | memoryview) -> tuple[int, list[int]]:
    r = Reader(body)
    slot_bytes, n = _U32X2.unpack(r.take(_U32X2.size))
    offsets = r.u64s(n)
    r.done()
    return int(slot_bytes), offsets


def encode_store(ns: str, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int]) -> bytes:
    if not len(sizes) == len(offsets) == len(keys):
        raise FrameError(f"{len(sizes)} sizes and {len(offsets)} slots for {len(keys)} keys")
    return ns_field(ns) + keys_field(keys) + u64s_field(sizes) + u64s_field(offsets)


def decode_store(body: bytes | memoryview) -> tuple[str, list[bytes], list[int], list[int]]:
    r = Reader(body)
    ns, keys = r.namespace(), r.keys()
    sizes = r.u64s(len(keys))
    offsets = r.u64s(len(keys))
    r.done()
    return ns, keys, sizes, offsets


def encode_store_reply(stored: int, outcomes: Sequence[int], refill: Sequence[int]) -> bytes:
    return _U32X2.pack(stored, len(outcomes)) + bytes(outcomes) + u64s_field(refill)


def decode_store_reply(body: bytes | memoryview) -> tuple[int, list[int], list[int]]:
    r = Reader(body)
    stored, n = _U32X2.unpack(r.take(_U32X2.size))
    outcomes = r.u8s(n)
    refill = r.u64s(n)
    r.done()
    return int(stored), outcomes, refill
