"""Priorities and expiries on top of any eviction policy: what the engine's hints (Retain, Release) set.

A hint is metadata, not a second eviction order: the wrapped policy (LRU, S3-FIFO) still decides among the
entries of one priority class, and ``choose_victim`` asks it up to three times:

    1. RELEASED entries, oldest release first (a session or branch that is done: its blocks go before any other)
    2. the policy's own choice among entries that are not RETAINED (an unexpired retention skips the entry)
    3. only when nothing in 2 is eligible (pressure): the policy's choice among every eligible entry,
       retained ones included; a retention is a preference, never a pin

A retention carries a deadline (monotonic seconds); past it the entry is normal again, with no sweep: the
deadline is compared when a victim is chosen. ``set_priority`` on an untracked id is ignored (False).
Removal, eviction and a new ``on_insert`` of a reused id clear the id's priority.

State: per capacity slot an int8 class and a float64 deadline (9 bytes; grown by doubling when an id is
first hinted, so a store that never hints holds none), plus a deque of released ids (each at most once while
marked; stale ones are skipped and the deque is compacted when it outgrows 2x the marked count + 64).
Hits (``on_access*``) and inserts go straight to the wrapped policy: bound as instance attributes, they cost
nothing extra on the read path; so do evictions and removals until the first ``set_priority``. Every method is amortised O(1) besides the wrapped policy's own work; pass 2
and 3 examine each tracked entry at most once each (the wrapped policy's bound), pass 1 each released id once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.policies.base import EvictionPolicy, grow_array, grown_capacity

__all__ = ["NORMAL", "RETAINED", "RELEASED", "HintedPolicy", "with_hints"]

NORMAL, RETAINED, RELEASED = 0, 1, -1
_PRIORITIES = (NORMAL, RETAINED, RELEASED)


class HintedPolicy(EvictionPolicy):
    """``inner`` with per-entry priorities (see the module docstring); named like ``inner``."""

    def __init__(self, inner: EvictionPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.name = inner.name
        self._clock = clock
        self._prio = np.zeros(0, dtype=np.int8)
        self._until = np.zeros(0, dtype=np.float64)
        self._released: deque[int] = deque()
        self._n_released = 0      # ids marked RELEASED now
        self._retain_until = 0.0  # latest deadline ever set: past it no entry is retained (the fast path)
        # the hot paths go straight to the wrapped policy (no extra Python frame per hit or insert)
        self.on_insert = inner.on_insert  # type: ignore[method-assign]
        self.on_insert_many = inner.on_insert_many  # type: ignore[method-assign]
        self.wants_fingerprints = inner.wants_fingerprints
        self.on_access = inner.on_access  # type: ignore[method-assign]
        self.on_access_many = inner.on_access_many  # type: ignore[method-assign]
        self.on_access_batches = inner.on_access_batches  # type: ignore[method-assign]
        # until the first hint, eviction and removal too: a store that never hints pays nothing
        self.choose_victim = inner.choose_victim  # type: ignore[method-assign]
        self.on_remove = inner.on_remove  # type: ignore[method-assign]

    # -- hints ------------------------------------------------------------------------------------------
    def set_priority(self, eid: int, priority: int, until: float = 0.0) -> bool:
        """Mark a tracked entry NORMAL, RETAINED until the monotonic time ``until``, or RELEASED; False (and
        nothing changes) when ``eid`` is not tracked. ValueError for an unknown priority."""
        if priority not in _PRIORITIES:
            raise ValueError(f"priority {priority} unknown: use NORMAL (0), RETAINED (1) or RELEASED (-1)")
        if eid not in self.inner:
            return False
        if not self._prio.shape[0]:  # the first hint: from now on eviction and removal go through this class
            del self.choose_victim, self.on_remove
        if eid >= self._prio.shape[0]:
            cap = grown_capacity(max(self._prio.shape[0], 64), eid)
            self._prio = grow_array(self._prio, cap, NORMAL)
            self._until = grow_array(self._until, cap, 0)
        self._clear(eid)
        self._prio[eid] = priority
        if priority == RETAINED:
            self._until[eid] = until
            self._retain_until = max(self._retain_until, until)
        elif priority == RELEASED:
            self._n_released += 1
            self._released.append(eid)
            if len(self._released) > 2 * self._n_released + 64:
                self._compact()
        return True

    def priority(self, eid: int, now: float | None = None) -> int:
        """The entry's class at ``now`` (default: the clock): an expired retention reads NORMAL."""
        if not 0 <= eid < self._prio.shape[0]:
            return NORMAL
        p = int(self._prio[eid])
        if p == RETAINED and self._until[eid] <= (self._clock() if now is None else now):
            return NORMAL
        return p

    def _clear(self, eid: int) -> None:
        if eid < self._prio.shape[0] and self._prio[eid] != NORMAL:
            if self._prio[eid] == RELEASED:
                self._n_released -= 1  # its deque slot turns stale
            self._prio[eid] = NORMAL

    def _compact(self) -> None:
        prio, seen = self._prio, set()
        kept: deque[int] = deque()
        for e in self._released:
            if prio[e] == RELEASED and e not in seen:
                seen.add(e)
                kept.append(e)
        self._released = kept

    # -- EvictionPolicy ---------------------------------------------------------------------------------
    def on_insert(self, eid: int, fingerprint: int = 0) -> None:  # replaced per instance (see __init__)
        self.inner.on_insert(eid, fingerprint)

    def on_insert_many(self, eids: Sequence[int],
                       fingerprints: Sequence[int] | None = None) -> None:  # replaced per instance (see __init__)
        self.inner.on_insert_many(eids, fingerprints)

    def on_access(self, eid: int) -> None:  # replaced per instance (see __init__)
        self.inner.on_access(eid)

    def on_remove(self, eid: int) -> None:
        self._clear(eid)
        self.inner.on_remove(eid)

    def choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        if self._n_released:
            victim = self._released_victim(eligible)
            if victim is not None:
                return victim
        now = self._clock()
        if now >= self._retain_until:  # no retention is live: the wrapped policy alone
            victim = self.inner.choose_victim(eligible)
        else:
            prio, until, n = self._prio, self._until, self._prio.shape[0]

            def unretained(eid: int) -> bool:
                return eligible(eid) and not (eid < n and prio[eid] == RETAINED and until[eid] > now)

            victim = self.inner.choose_victim(unretained)
            if victim is None:
                victim = self.inner.choose_victim(eligible)  # under pressure: retained entries go too
        if victim is not None:
            self._clear(victim)
        return victim

    def _released_victim(self, eligible: Callable[[int], bool]) -> int | None:
        """The oldest eligible RELEASED entry, forgotten; ineligible ones keep their place."""
        skipped: list[int] = []
        victim = None
        prio, released = self._prio, self._released
        while released:
            eid = released.popleft()
            if prio[eid] != RELEASED or eid not in self.inner:
                continue  # stale: hinted again, removed or evicted since
            if eligible(eid):
                victim = eid
                break
            skipped.append(eid)
        released.extendleft(reversed(skipped))
        if victim is not None:
            self._clear(victim)
            self.inner.on_remove(victim)
        return victim

    def __len__(self) -> int:
        return len(self.inner)

    def order(self) -> list[int]:
        return self.inner.order()

    def hinted(self, now: float) -> list[tuple[int, int, float]]:
        """(id, priority, seconds left of a retention; 0 for a release) of every tracked entry with a hint."""
        ids = np.flatnonzero(self._prio != NORMAL)
        out = []
        for eid in ids.tolist():
            p = self.priority(eid, now)
            if p != NORMAL and eid in self.inner:
                out.append((eid, p, max(0.0, float(self._until[eid]) - now) if p == RETAINED else 0.0))
        return out

    def __contains__(self, eid: object) -> bool:
        return eid in self.inner

    def memory_bytes(self) -> int:
        """The wrapped policy's arrays plus 9 bytes per hinted-capacity slot (the released deque aside)."""
        return self.inner.memory_bytes() + self._prio.nbytes + self._until.nbytes


def with_hints(policy: EvictionPolicy) -> HintedPolicy:
    """``policy`` able to take hints: itself when it already is a HintedPolicy, else wrapped."""
    return policy if isinstance(policy, HintedPolicy) else HintedPolicy(policy)
