"""ArenaSlot: the client's current arena mapping, and when to ask for it again.

A reconnect swaps the mapping (the old one is retired, unmapped once the copies still using it are done, see
arena_map.py); copies take a reference through acquire(). A client in auto mode whose handoff failed for a
reason that can pass (connect.map_arena's `transient`) streams meanwhile and sets `retry_at`, so the data path
asks for the arena again instead of streaming until the next reconnect.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from kvstore.client.arena_map import ArenaMap

__all__ = ["ArenaSlot"]


class ArenaSlot:
    def __init__(self) -> None:
        self.map: ArenaMap | None = None   # read without the lock: a reference swap is atomic
        self.retry_at: float | None = None  # auto mode after a transient handoff failure: when to retry
        self._lock = threading.Lock()       # guards the swap against acquire()

    def swap(self, new: ArenaMap | None) -> None:
        with self._lock:
            old, self.map = self.map, new
        if old is not None:
            old.retire()

    def acquire(self, incarnation: int | None) -> ArenaMap | None:
        """The mapping with a reference taken, or None (none, or of another daemon incarnation)."""
        with self._lock:
            m = self.map
            if m is None or (incarnation is not None and m.incarnation != incarnation) or not m.acquire():
                return None
            return m

    def generations(self, incarnation: int, offsets: np.ndarray) -> np.ndarray | None:
        """The generations of the slots at `offsets` in daemon `incarnation`'s arena; None when that is not the
        mapped one (FastControl answers a Lookup without lease from the shared key index with them)."""
        m = self.acquire(incarnation)
        if m is None:
            return None
        with m:
            return m.generations_at(offsets)

    def retry_due(self) -> bool:
        return self.map is None and self.retry_at is not None and time.monotonic() >= self.retry_at
