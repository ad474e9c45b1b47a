"""Exact LRU as an intrusive doubly-linked list stored in two int32 arrays (``array.array``).

``array.array`` rather than numpy: every operation reads or writes single elements, and a scalar access to
an ``array`` costs a fraction of a numpy scalar access (which boxes a numpy integer each time).

``_prev[eid]`` / ``_next[eid]`` link entries from most recent (head) to
least recent (tail).  A separate "tracked" flag would cost a byte per id, so
membership is encoded in ``_prev`` itself: ``_UNTRACKED`` marks a free slot.
That keeps the footprint at 8 bytes per capacity slot, i.e. <= 16 bytes per
tracked id even right after a doubling.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import numpy as np

from kvstore.policies.base import (
    DEFAULT_INITIAL_CAPACITY,
    EvictionPolicy,
    check_new_eid,
    grown_capacity,
)

_NIL = -1  # end of list
_UNTRACKED = -2  # in _prev: slot holds no tracked entry


class LRUPolicy(EvictionPolicy):
    """Victims in order of least recent insert or access.

    Every operation is O(1) except ``choose_victim`` skipping ineligible
    entries, which walks from the LRU end towards the MRU end and examines
    each tracked entry at most once per call; skipped entries keep their
    position (being leased is not a use).
    """

    name = "lru"

    def __init__(self, initial_capacity: int = DEFAULT_INITIAL_CAPACITY) -> None:
        cap = max(int(initial_capacity), 1)
        self._prev = array("i", [_UNTRACKED]) * cap
        self._next = array("i", [_NIL]) * cap
        self._head = _NIL  # most recently used
        self._tail = _NIL  # least recently used
        self._count = 0

    # -- list primitives ---------------------------------------------------

    def _push_head(self, eid: int) -> None:
        self._prev[eid] = _NIL
        self._next[eid] = self._head
        if self._head != _NIL:
            self._prev[self._head] = eid
        else:
            self._tail = eid
        self._head = eid

    def _unlink(self, eid: int) -> None:
        prev = self._prev[eid]
        nxt = self._next[eid]
        if prev != _NIL:
            self._next[prev] = nxt
        else:
            self._head = nxt
        if nxt != _NIL:
            self._prev[nxt] = prev
        else:
            self._tail = prev

    def _forget(self, eid: int) -> None:
        self._unlink(eid)
        self._prev[eid] = _UNTRACKED
        self._next[eid] = _NIL
        self._count -= 1

    def _tracked(self, eid: int) -> bool:
        return 0 <= eid < len(self._prev) and self._prev[eid] != _UNTRACKED

    # -- EvictionPolicy ----------------------------------------------------

    def on_insert(self, eid: int, fingerprint: int = 0) -> None:
        """Track ``eid`` as most recently used; ``fingerprint`` is unused."""
        check_new_eid(eid)
        if eid >= len(self._prev):
            extra = grown_capacity(len(self._prev), eid) - len(self._prev)
            self._prev.extend(array("i", [_UNTRACKED]) * extra)
            self._next.extend(array("i", [_NIL]) * extra)
        elif self._prev[eid] != _UNTRACKED:
            raise ValueError(f"entry {eid} is already tracked")
        self._push_head(eid)
        self._count += 1

    def on_access(self, eid: int) -> None:
        """Move ``eid`` to the most-recent end."""
        if self._tracked(eid) and eid != self._head:
            self._unlink(eid)
            self._push_head(eid)

    def on_access_many(self, eids) -> None:  # type: ignore[override]
        on_access = self.on_access
        for eid in (eids.tolist() if isinstance(eids, np.ndarray) else eids):
            on_access(eid)

    def on_remove(self, eid: int) -> None:
        """Forget ``eid`` wherever it is in the list."""
        if self._tracked(eid):
            self._forget(eid)

    def choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        """Forget and return the least recent eligible entry."""
        eid = self._tail
        while eid != _NIL:
            if eligible(eid):
                self._forget(eid)
                return eid
            eid = self._prev[eid]
        return None

    def __len__(self) -> int:
        return self._count

    def __contains__(self, eid: object) -> bool:
        return isinstance(eid, (int, np.integer)) and self._tracked(int(eid))

    def memory_bytes(self) -> int:
        """8 bytes per capacity slot."""
        return (len(self._prev) + len(self._next)) * self._prev.itemsize
