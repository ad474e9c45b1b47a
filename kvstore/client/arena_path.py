"""Same-node data path: copy between user buffers and the daemon's arena, no bytes over gRPC.

A write fills reserved slots; a read copies leased slots out and then checks each slot's generation in the
arena header: a slot whose generation moved was reclaimed during the copy (the lease expired), so that copy
is reported as a miss and its bytes are never handed to the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore._native import copy_addrs
from kvstore.arena.shm import ArenaLayout, ClientArena, attach_arena
from kvstore.client.types import Lease, Reservation
from kvstore.errors import InvalidRequestError
from kvstore.hostinfo import byte_view

__all__ = ["ArenaPath"]


def _address(buf: object, writable: bool) -> tuple[int, int, np.ndarray]:
    arr = byte_view(buf)
    if writable and not arr.flags.writeable:
        raise InvalidRequestError("destination buffer is read-only: pass a bytearray, numpy array or writable memoryview")
    if not arr.flags.c_contiguous:
        raise InvalidRequestError("buffer must be C-contiguous")
    return arr.ctypes.data, arr.nbytes, arr


class ArenaPath:
    def __init__(self, layout: ArenaLayout, incarnation: int, copy_threads: int = 1) -> None:
        self.arena: ClientArena = attach_arena(layout)
        self.layout = layout
        self.incarnation = incarnation
        self.copy_threads = copy_threads

    def write(self, reservation: Reservation, values: Sequence[object]) -> list[int]:
        """Copy values[i] into the slots of every RESERVED key; returns the indices written."""
        idx = reservation.reserved_indices
        if not idx:
            return idx
        base = self.arena.address
        keep = []
        src = np.empty(len(idx), dtype=np.uint64)
        dst = np.empty(len(idx), dtype=np.uint64)
        lengths = np.empty(len(idx), dtype=np.uint64)
        for j, i in enumerate(idx):
            addr, n, arr = _address(values[i], writable=False)
            keep.append(arr)
            src[j], dst[j], lengths[j] = addr, base + reservation.offsets[i], n
        copy_addrs(dst, src, lengths, threads=self.copy_threads)
        return idx

    def read_into(self, lease: Lease, buffers: Sequence[object]) -> list[int | None]:
        """Copy each hit into buffers[hit_index]; None for a hit whose slot was reclaimed during the copy."""
        n = lease.hits
        src = np.empty(n, dtype=np.uint64)
        dst = np.empty(n, dtype=np.uint64)
        lengths = np.asarray(lease.sizes, dtype=np.uint64)
        keep = []
        base = self.arena.address
        for j in range(n):
            addr, cap, arr = _address(buffers[j], writable=True)
            if cap < lease.sizes[j]:
                raise InvalidRequestError(f"buffer {j} holds {cap} bytes but the block has {lease.sizes[j]}")
            keep.append(arr)
            src[j], dst[j] = base + lease.offsets[j], addr
        copy_addrs(dst, src, lengths, threads=self.copy_threads)
        return self._validated(lease, [int(x) for x in lease.sizes])

    def read_bytes(self, lease: Lease) -> list[bytes | None]:
        mm = self.arena.mmap
        out: list[bytes | None] = [mm[o: o + s] for o, s in zip(lease.offsets, lease.sizes)]
        ok = self._validated(lease, [1] * lease.hits)
        return [b if v is not None else None for b, v in zip(out, ok)]

    def _validated(self, lease: Lease, values: list[int]) -> list[int | None]:
        if not lease.hits:
            return []
        offs = np.asarray(lease.offsets, dtype=np.int64)
        now = self.arena.generations[(offs - self.layout.data_offset) // self.layout.page_bytes]
        same = now == np.asarray(lease.generations, dtype=np.uint64)
        return [v if ok else None for v, ok in zip(values, same.tolist())]

    def close(self) -> None:
        self.arena.close()
