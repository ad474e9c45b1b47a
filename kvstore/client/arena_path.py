"""Same-node data path: copy between user buffers and the arena mapping, no bytes over gRPC.

A write fills reserved slots; a read copies leased slots out and then checks each slot's generation in the
arena header: a slot whose generation moved was reclaimed during the copy (the lease expired), so that copy
is reported as a miss and its bytes are never handed to the caller.

Every function takes an `ArenaMap` the caller has acquired (arena_map.py) and of the same daemon incarnation
as the reservation or lease: offsets mean nothing in another daemon's arena.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from kvstore._native import copy_addrs
from kvstore.client.arena_map import ArenaMap
from kvstore.client.types import Lease, Reservation
from kvstore.errors import InvalidRequestError
from kvstore.hostinfo import byte_view

__all__ = ["write", "write_slots", "read_into", "read_bytes", "validated"]


def _address(buf: object, writable: bool) -> tuple[int, int, np.ndarray]:
    arr = byte_view(buf)
    if writable and not arr.flags.writeable:
        raise InvalidRequestError("destination buffer is read-only: pass a bytearray, numpy array or writable memoryview")
    if not arr.flags.c_contiguous:
        raise InvalidRequestError("buffer must be C-contiguous")
    return arr.ctypes.data, arr.nbytes, arr


def _check_slots(m: ArenaMap, offsets: Sequence[int], sizes: Sequence[int]) -> None:
    """An offset outside the mapping would be a wild write: refuse it rather than trust the wire."""
    for off, n in zip(offsets, sizes):
        if not m.layout.contains_slot(int(off), int(n)):
            raise InvalidRequestError(f"slot [{off}, +{n}) is outside the arena's data region")


def write(m: ArenaMap, reservation: Reservation, values: Sequence[object], threads: int = 1) -> list[int]:
    """Copy values[i] into the slots of every RESERVED key; returns the indices written."""
    idx = reservation.reserved_indices
    if idx:
        write_slots(m, [reservation.offsets[i] for i in idx], [values[i] for i in idx], threads)
    return idx


def write_slots(m: ArenaMap, offsets: Sequence[int], values: Sequence[object], threads: int = 1) -> None:
    """Copy values[j] into the slot at offsets[j] (reserved, or a spare slot: kvstore/client/spare_puts.py)."""
    keep = []
    src = np.empty(len(offsets), dtype=np.uint64)
    dst = np.empty(len(offsets), dtype=np.uint64)
    lengths = np.empty(len(offsets), dtype=np.uint64)
    for j, off in enumerate(offsets):
        addr, n, arr = _address(values[j], writable=False)
        keep.append(arr)
        src[j], dst[j], lengths[j] = addr, m.address + off, n
    _check_slots(m, offsets, lengths.tolist())
    copy_addrs(dst, src, lengths, threads=threads)


def read_into(m: ArenaMap, lease: Lease, buffers: Sequence[object], threads: int = 1) -> list[int | None]:
    """Copy each hit into buffers[hit_index]; None for a hit whose slot was reclaimed during the copy."""
    n = lease.hits
    src = np.empty(n, dtype=np.uint64)
    dst = np.empty(n, dtype=np.uint64)
    lengths = np.asarray(lease.sizes, dtype=np.uint64)
    _check_slots(m, lease.offsets, lease.sizes)
    keep = []
    for j in range(n):
        addr, cap, arr = _address(buffers[j], writable=True)
        if cap < lease.sizes[j]:
            raise InvalidRequestError(f"buffer {j} holds {cap} bytes but the block has {lease.sizes[j]}")
        keep.append(arr)
        src[j], dst[j] = m.address + lease.offsets[j], addr
    copy_addrs(dst, src, lengths, threads=threads)
    return validated(m, lease, [int(x) for x in lease.sizes])


def read_bytes(m: ArenaMap, lease: Lease) -> list[bytes | None]:
    _check_slots(m, lease.offsets, lease.sizes)
    out = [ctypes.string_at(m.address + o, s) for o, s in zip(lease.offsets, lease.sizes)]
    ok = validated(m, lease, [1] * lease.hits)
    return [b if v is not None else None for b, v in zip(out, ok)]


def validated(m: ArenaMap, lease: Lease, values: list[int]) -> list[int | None]:
    """values[i] where hit i's slot still holds the leased block, else None (checked after the copy)."""
    if not lease.hits:
        return []
    now = m.generations_at(np.asarray(lease.offsets, dtype=np.int64))
    same = now == np.asarray(lease.generations, dtype=np.uint64)
    return [v if ok else None for v, ok in zip(values, same.tolist())]
