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
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.policies.base import (
    DEFAULT_INITIAL_CAPACITY,
    EvictionPolicy,
    check_new_eid,
    grown_capacity,
)

_NIL = -1  # end of list
_UNTRACKED = -2  # in _prev: slot holds no tracked entry
_BATCH_MIN = 16  # on_access_many: below this, the per-id loop beats the fixed cost of the numpy calls
_RUN_COST = 4    # on_access_many: one run costs about as much as this many ids of the per-id loop


def _last_occurrences_reversed(ids: np.ndarray) -> np.ndarray:
    """Each id once, ordered by its last occurrence in `ids`, latest first."""
    recent = ids[::-1]
    ordered = np.sort(recent)
    if not (ordered[1:] == ordered[:-1]).any():
        return recent
    _, first = np.unique(recent, return_index=True)
    return recent[np.sort(first)]


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

    wants_fingerprints = False

    def on_insert_many(self, eids: Sequence[int], fingerprints: Sequence[int] | None = None) -> None:
        """``on_insert`` of each in order: the checks for all first (nothing changes when one fails), then the
        links in one loop."""
        if len(eids) < 2:
            for eid in eids:
                self.on_insert(eid)
            return
        for eid in eids:
            check_new_eid(eid)
        top = max(eids)
        if top >= len(self._prev):
            extra = grown_capacity(len(self._prev), top) - len(self._prev)
            self._prev.extend(array("i", [_UNTRACKED]) * extra)
            self._next.extend(array("i", [_NIL]) * extra)
        prev, nxt = self._prev, self._next
        if len(set(eids)) != len(eids) or any(prev[eid] != _UNTRACKED for eid in eids):
            raise ValueError(f"an entry of {list(eids)[:8]} is already tracked (or named twice)")
        head = self._head
        for eid in eids:
            prev[eid] = _NIL
            nxt[eid] = head
            if head != _NIL:
                prev[head] = eid
            else:
                self._tail = eid
            head = eid
        self._head = head
        self._count += len(eids)

    def on_access(self, eid: int) -> None:
        """Move ``eid`` to the most-recent end."""
        if self._tracked(eid) and eid != self._head:
            self._unlink(eid)
            self._push_head(eid)

    def on_access_many(self, eids: Sequence[int] | np.ndarray) -> None:
        """The same end state as ``on_access`` of each id in order, in O(1) numpy calls for the common batch.

        Move-to-front has a closed form: after accesses a_1..a_m, the distinct tracked ids sit at the head in
        order of their last access (most recent first), followed by every other entry in its old order. So the
        batch is reduced to that order (``recent``), the stretches of it that already lie in the list in that
        order (runs: a chain committed together and read together is one) are cut out, and ``recent`` is linked
        in at the head. That costs one Python step per run; a batch of scattered ids (many short runs) takes
        the per-id loop instead, which is cheaper there.
        """
        ids = np.asarray(eids, dtype=np.int64)
        if ids.shape[0] < _BATCH_MIN:
            self._access_each(ids.tolist())
            return
        prev = np.frombuffer(self._prev, dtype=np.int32)  # views of the link arrays, dropped before returning:
        nxt = np.frombuffer(self._next, dtype=np.int32)   # array.extend (on_insert) refuses while one is held
        ids = ids[(ids >= 0) & (ids < prev.shape[0])]
        ids = ids[prev[ids] != _UNTRACKED]
        if ids.shape[0] < 2:
            self._access_each(ids.tolist())
            return
        latest_first = ids[::-1]
        if (np.count_nonzero(nxt[latest_first[:-1]] != latest_first[1:]) + 1) * _RUN_COST > ids.shape[0]:
            self._access_each(ids.tolist())  # scattered: not worth finding each id's last read first
            return
        recent = _last_occurrences_reversed(ids)
        k = recent.shape[0]
        if k == 0:
            return
        ends = np.flatnonzero(nxt[recent[:-1]] != recent[1:])  # index of the last id of each run but the last
        if (ends.shape[0] + 1) * _RUN_COST > k:
            self._access_each(ids.tolist())
            return
        starts = recent[np.concatenate(([0], ends + 1))].tolist()
        lasts = recent[np.concatenate((ends, [k - 1]))].tolist()
        aprev, anext = self._prev, self._next
        head, tail = self._head, self._tail
        for first, last in zip(starts, lasts):  # cut each run out (its inner links stay as they are)
            before, after = aprev[first], anext[last]
            if before != _NIL:
                anext[before] = after
            else:
                head = after
            if after != _NIL:
                aprev[after] = before
            else:
                tail = before
        nxt[recent[:-1]] = recent[1:]  # link `recent` as one chain in front of what is left
        prev[recent[1:]] = recent[:-1]
        first, last = int(recent[0]), int(recent[-1])
        aprev[first] = _NIL
        anext[last] = head
        if head != _NIL:
            aprev[head] = last
        else:
            tail = last
        self._head, self._tail = first, tail

    def on_access_batches(self, batches: Sequence[np.ndarray]) -> None:
        """Skips each batch that is a prefix of the next one kept (a Lookup repeated, or one of a longer chain):
        every id in it is read again later, and only an id's last read decides its place."""
        kept: list[np.ndarray] = []
        later: np.ndarray | None = None
        for ids in reversed(batches):
            n = ids.shape[0]
            if later is not None and n <= later.shape[0] and np.array_equal(ids, later[:n]):
                continue
            kept.append(ids)
            later = ids
        if kept:
            kept.reverse()
            self.on_access_many(kept[0] if len(kept) == 1 else np.concatenate(kept))

    def _access_each(self, eids: list[int]) -> None:
        """``on_access`` of each id in order, with the list primitives inlined."""
        aprev, anext = self._prev, self._next
        head, tail, cap = self._head, self._tail, len(aprev)
        for eid in eids:
            if eid == head or not 0 <= eid < cap:
                continue
            before = aprev[eid]
            if before == _UNTRACKED:
                continue
            after = anext[eid]  # tracked and not the head: `before` is an entry
            anext[before] = after
            if after != _NIL:
                aprev[after] = before
            else:
                tail = before
            aprev[eid] = _NIL
            anext[eid] = head
            aprev[head] = eid
            head = eid
        self._head, self._tail = head, tail

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

    def order(self) -> list[int]:
        """Least recent first (see EvictionPolicy.order)."""
        out, eid, prev = [], self._tail, self._prev
        while eid != _NIL:
            out.append(eid)
            eid = prev[eid]
        return out

    def __contains__(self, eid: object) -> bool:
        return isinstance(eid, (int, np.integer)) and self._tracked(int(eid))

    def memory_bytes(self) -> int:
        """8 bytes per capacity slot."""
        return (len(self._prev) + len(self._next)) * self._prev.itemsize
