"""Same-node data path: copy between user buffers and the arena mapping, no bytes over gRPC.

A write fills reserved slots; a read copies leased slots out and then checks each slot's generation in the
arena header: a slot whose generation moved was reclaimed during the copy (the lease expired), so that copy
is reported as a miss and its bytes are never handed to the caller.

Every function takes an `ArenaMap` the caller has acquired (arena_map.py) and of the same daemon incarnation
as the reservation or lease: offsets mean nothing in another daemon's arena.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np

from kvstore._native import copy_buffers
from kvstore.client.arena_map import ArenaMap
from kvstore.client.types import Lease, Reservation
from kvstore.errors import InvalidRequestError

__all__ = ["write", "write_slots", "SlotWriter", "read_into", "read_bytes", "validated", "nbytes_of"]


def nbytes_of(values: Sequence[object]) -> list[int]:
    """Each value's size in bytes. A numpy array answers from its shape (`nbytes`) without exporting its buffer:
    a put of 32 blocks asked memoryview for this twice a block, ~20 us of its control path with the caches
    cold from the copy before. Anything else is asked through memoryview (which also refuses a non-buffer)."""
    return [v.nbytes if type(v) is np.ndarray else memoryview(v).nbytes for v in values]  # type: ignore[arg-type]  # any buffer; 3.11 has no Buffer type


def _check_slots(m: ArenaMap, offsets: Sequence[int], sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """An offset outside the mapping would be a wild write: refuse it rather than trust the wire. The offsets as
    uint64 (what the copy's addresses are made from), checked in one C call (ArenaLayout.first_outside)."""
    try:
        offs = np.asarray(offsets, dtype=np.uint64)
        bad = m.layout.first_outside(offs, np.asarray(sizes, dtype=np.uint64))
    except OverflowError:  # negative, or past 64 bits (never inside): one by one says which
        bad = next((i for i, (o, n) in enumerate(zip(offsets, sizes)) if not m.layout.contains_slot(int(o), int(n))),
                   0)
    if bad >= 0:
        raise InvalidRequestError(f"slot [{offsets[bad]}, +{sizes[bad]}) is outside the arena's data region")
    return offs


def write(m: ArenaMap, reservation: Reservation, values: Sequence[object], threads: int = 1) -> list[int]:
    """Copy values[i] into the slots of every RESERVED key; returns the indices written."""
    idx = reservation.reserved_indices
    if idx:
        write_slots(m, [reservation.offsets[i] for i in idx], [values[i] for i in idx], threads)
    return idx


def write_slots(m: ArenaMap, offsets: Sequence[int], values: Sequence[object], threads: int = 1) -> None:
    """Copy values[j] into the slot at offsets[j] (reserved, or a spare slot: kvstore/client/spare_puts.py)."""
    SlotWriter(m, offsets, values, threads).copy(0, len(offsets))


class SlotWriter:
    """Copies values[j] into the slot at offsets[j], a range of blocks at a time. Its slots are checked when it is
    made, the values by each copy before it moves a byte, or all at once by `check` (a put sent in parts,
    spare_puts.py, calls it first, so that it never fails after its first part went out)."""

    def __init__(self, m: ArenaMap, offsets: Sequence[int], values: Sequence[object], threads: int = 1,
                 lengths: Sequence[int] | None = None) -> None:
        """`lengths`: nbytes_of(values) when the caller has it already."""
        self._values = list(values)  # held (with their buffers exported during each copy) until the copy is done
        # buffer sizes fit uint64, and the check takes the array as it is: one conversion, not two
        self._lengths = np.asarray(nbytes_of(self._values) if lengths is None else lengths, dtype=np.uint64)
        self._dst = _check_slots(m, offsets, self._lengths) + np.uint64(m.address)  # inside the mapping: no wrap
        self._threads = threads

    def check(self) -> None:
        """InvalidRequestError unless every value can be copied (a buffer that is not C-contiguous)."""
        _checked(lambda: copy_buffers(self._dst, self._lengths, self._values, check_only=True))

    def copy(self, start: int, stop: int) -> None:
        """Copy blocks start..stop-1."""
        _checked(lambda: copy_buffers(self._dst[start:stop], self._lengths[start:stop], self._values[start:stop],
                                      threads=self._threads))


def _checked(copy: Callable[[], int]) -> int:
    """copy_buffers' complaint about a caller's buffer (read-only, not contiguous, too small) as the API's error."""
    try:
        return copy()
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None


def read_into(m: ArenaMap, lease: Lease, buffers: Sequence[object], threads: int = 1) -> list[int | None]:
    """Copy each hit into buffers[hit_index]; None for a hit whose slot was reclaimed during the copy."""
    n = lease.hits
    src = _check_slots(m, lease.offsets, lease.sizes)[:n] + np.uint64(m.address)
    _checked(lambda: copy_buffers(src, np.asarray(lease.sizes[:n], dtype=np.uint64), list(buffers[:n]),
                                  into_buffers=True, threads=threads))
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
