"""Arena transfers as the daemon sees them, timed into the TransferMeter (plane "arena", tier "ram").

The bytes of an arena transfer never reach the daemon: the client copies them into or out of shared memory.
What the daemon sees is the window around the copy, and that is what is timed:

    put   Reserve (slots handed out)  -> Commit   bytes = the reserved blocks' sizes; an Abort observes nothing
    get   Lookup with a lease         -> Release  bytes = the leased blocks' sizes, counted when leased
    get   answered from the key index (the client's one-way HITS, flag HITS_READ): bytes only, no window
    put   Store into spare slots (one request after the copy): bytes only, no window

So a window includes the client's RPC round trips and, for gets, the client's asynchronous release (a few
hundred microseconds), and a lease held on purpose (the vLLM scheduler leases before the worker copies)
looks like a slow copy. The GB/s histogram is a lower bound of the copy speed, exact for the end to end
rate a client gets. Leases that expire are never released: their bytes are counted, their window is not.
Reserve/Lookup calls made by the Put/Get streams do not come through here (they are the "stream" plane).

Open windows are bounded (`limit` each); the oldest is forgotten first (it has long expired anyway).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.transfers import TransferMeter

__all__ = ["ArenaWindows"]


class ArenaWindows:
    def __init__(self, meter: TransferMeter, limit: int = 1 << 16) -> None:
        self._meter = meter
        self._limit = limit
        self._lock = threading.Lock()
        self._puts: OrderedDict[int, tuple[float, int]] = OrderedDict()
        self._gets: OrderedDict[int, tuple[float, int]] = OrderedDict()

    def reserved(self, reservation_id: int, nbytes: int) -> None:
        if reservation_id and nbytes:
            self._open(self._puts, reservation_id, nbytes)

    def committed(self, reservation_id: int) -> None:
        opened = self._close(self._puts, reservation_id)
        if opened is not None:
            t0, nbytes = opened
            self._meter.observe("arena", "ram", "in", nbytes, time.perf_counter() - t0)

    def aborted(self, reservation_id: int) -> None:
        self._close(self._puts, reservation_id)

    def leased(self, lease_id: int, nbytes: int) -> None:
        if lease_id and nbytes:
            self._meter.add_bytes("arena", "ram", "out", nbytes)
            self._open(self._gets, lease_id, nbytes)

    def unwindowed(self, direction: str, nbytes: int) -> None:
        """Bytes a client copied with no window the daemon saw around the copy: out of the arena with no lease
        (a get answered from its key index), into spare slots (a Store). Counted, never timed."""
        if nbytes:
            self._meter.add_bytes("arena", "ram", direction, nbytes)

    def released(self, lease_ids: Sequence[int]) -> None:
        now = time.perf_counter()
        for lid in lease_ids:
            opened = self._close(self._gets, lid)
            if opened is not None:
                t0, nbytes = opened
                self._meter.observe("arena", "ram", "out", nbytes, now - t0, count_bytes=False)

    def _open(self, table: OrderedDict[int, tuple[float, int]], ident: int, nbytes: int) -> None:
        with self._lock:
            table[ident] = (time.perf_counter(), nbytes)
            if len(table) > self._limit:
                table.popitem(last=False)

    def _close(self, table: OrderedDict[int, tuple[float, int]], ident: int) -> tuple[float, int] | None:
        with self._lock:
            return table.pop(ident, None)
