"""S3-FIFO (Yang et al., SOSP'23) over dense entry ids.

Three queues: a small FIFO ``S`` (~10% of tracked entries) that filters
one-hit wonders, a main FIFO ``M`` run as a 2-bit CLOCK, and a ghost ``G``
remembering entries recently evicted from ``S``.

* insert: to ``M`` if the fingerprint is in ``G`` (it is removed from ``G``),
  else to ``S``; frequency starts at 0.
* access: frequency += 1, saturating at 3.
* evict: from ``S`` when ``|S| >= small_fraction * tracked`` (or ``M`` is
  empty), else from ``M``.  The ``S`` tail moves to ``M`` (frequency reset to
  0, as libCacheSim re-admits it) if it was accessed, else it is evicted and
  its fingerprint enters ``G``.  The ``M`` tail with frequency > 0 is
  re-inserted at the ``M`` head with frequency - 1, else evicted.

Leased/pinned entries (``eligible(eid)`` False) that the algorithm would evict
are re-inserted at the head of their own queue instead, unchanged.

Both FIFOs share one pair of int32 link arrays (an entry is in at most one
queue) so that ``on_remove`` can unlink from the middle in O(1).  Per
capacity slot: 4 + 4 (links) + 1 (queue) + 1 (freq) + 8 (fingerprint) = 18
bytes, i.e. ~18.9 bytes per id at 1M ids in 2**20 slots.

Ids are reused by the catalog, so the ghost is keyed by the caller's 64-bit
content fingerprint (``on_insert(eid, fingerprint)``), not by id; entries
inserted with fingerprint 0 are never remembered.  The ghost is bounded to
``ghost_entries`` fingerprints, or by default to the number of tracked
entries at the time of the eviction, at most 65536; it is trimmed (oldest
first) when it grows.  It is a numpy ring of fingerprints in eviction order
plus a ``dict`` fingerprint -> ring sequence number for O(1) membership and
O(1) lazy removal on a ghost hit; ``ghost_memory_bytes()`` estimates it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.policies.base import (
    DEFAULT_INITIAL_CAPACITY,
    EvictionPolicy,
    check_new_eid,
    grow_array,
    grown_capacity,
)

_NIL = -1
_NONE, _SMALL, _MAIN = 0, 1, 2  # values of _queue[eid]
_MAX_FREQ = 3
_BATCH_MIN = 8  # on_access_many: below this, per-id calls beat the fixed cost of the numpy calls
_FP_MASK = (1 << 64) - 1
DEFAULT_GHOST_CAP = 65536


class _Ghost:
    """Bounded FIFO set of fingerprints, oldest dropped first.

    A hit removes the fingerprint from the dict only; its ring slot turns
    stale and is skipped when the ring is trimmed or compacted.  The ring is
    compacted when full and doubled when still at least half live afterwards,
    so every operation is amortised O(1) and the ring stays < 4x the bound.
    """

    def __init__(self) -> None:
        self._ring = np.zeros(64, dtype=np.uint64)
        self._seq_of: dict[int, int] = {}
        self._head = 0  # sequence number of the oldest ring slot
        self._next = 0  # sequence number the next add gets

    def __len__(self) -> int:
        return len(self._seq_of)

    def __contains__(self, fp: int) -> bool:
        return fp in self._seq_of

    def discard(self, fp: int) -> bool:
        """Remove ``fp``; return whether it was present."""
        return self._seq_of.pop(fp, None) is not None

    def add(self, fp: int, limit: int) -> None:
        """Remember ``fp`` as the newest entry, keeping at most ``limit``."""
        if limit <= 0:
            self._seq_of.clear()
            self._head = self._next
            return
        if self._next - self._head == self._ring.shape[0]:
            self._compact()
        self._ring[self._next % self._ring.shape[0]] = fp
        self._seq_of[fp] = self._next  # a stale older slot for fp stays stale
        self._next += 1
        while len(self._seq_of) > limit:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        size = self._ring.shape[0]
        while self._head < self._next:
            seq = self._head
            self._head += 1
            fp = int(self._ring[seq % size])
            if self._seq_of.get(fp) == seq:
                del self._seq_of[fp]
                return

    def _compact(self) -> None:
        size = self._ring.shape[0]
        seqs = np.arange(self._head, self._next, dtype=np.int64)
        live = [
            fp
            for seq, fp in zip(seqs.tolist(), self._ring[seqs % size].tolist())
            if self._seq_of.get(fp) == seq
        ]
        new_size = size * 2 if 2 * len(live) >= size else size
        self._ring = np.zeros(new_size, dtype=np.uint64)
        self._ring[: len(live)] = np.array(live, dtype=np.uint64)
        self._seq_of = {fp: i for i, fp in enumerate(live)}
        self._head, self._next = 0, len(live)

    def memory_bytes(self) -> int:
        """Estimate: ring + dict table + one boxed int key per entry."""
        return int(self._ring.nbytes + sys.getsizeof(self._seq_of) + 36 * len(self._seq_of))


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO; see the module docstring for the algorithm and the layout.

    ``choose_victim`` examines each ``S`` entry at most once and rotates ``M``
    at most 4 times (a rotation without any frequency decrement and without
    an eligible entry ends the search), so it always terminates.
    """

    name = "s3fifo"

    def __init__(
        self,
        small_fraction: float = 0.1,
        ghost_entries: int | None = None,
        initial_capacity: int = DEFAULT_INITIAL_CAPACITY,
    ) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        if ghost_entries is not None and ghost_entries < 0:
            raise ValueError(f"ghost_entries must be >= 0, got {ghost_entries}")
        self._small_fraction = float(small_fraction)
        self._ghost_entries = ghost_entries
        cap = max(int(initial_capacity), 1)
        self._prev = np.full(cap, _NIL, dtype=np.int32)
        self._next = np.full(cap, _NIL, dtype=np.int32)
        self._queue = np.zeros(cap, dtype=np.int8)
        self._freq = np.zeros(cap, dtype=np.int8)
        self._fp = np.zeros(cap, dtype=np.uint64)
        # Index 0 unused; _SMALL and _MAIN index head (newest), tail, size.
        self._qhead = [_NIL, _NIL, _NIL]
        self._qtail = [_NIL, _NIL, _NIL]
        self._qsize = [0, 0, 0]
        self._ghost = _Ghost()

    # -- queue primitives --------------------------------------------------

    def _push_head(self, q: int, eid: int) -> None:
        head = self._qhead[q]
        self._queue[eid] = q
        self._prev[eid] = _NIL
        self._next[eid] = head
        if head != _NIL:
            self._prev[head] = eid
        else:
            self._qtail[q] = eid
        self._qhead[q] = eid
        self._qsize[q] += 1

    def _unlink(self, eid: int) -> None:
        q = int(self._queue[eid])
        prev = int(self._prev[eid])
        nxt = int(self._next[eid])
        if prev != _NIL:
            self._next[prev] = nxt
        else:
            self._qhead[q] = nxt
        if nxt != _NIL:
            self._prev[nxt] = prev
        else:
            self._qtail[q] = prev
        self._queue[eid] = _NONE
        self._qsize[q] -= 1

    def _tracked(self, eid: int) -> bool:
        return 0 <= eid < self._queue.shape[0] and self._queue[eid] != _NONE

    def _ghost_limit(self) -> int:
        if self._ghost_entries is not None:
            return self._ghost_entries
        return min(len(self), DEFAULT_GHOST_CAP)

    # -- EvictionPolicy ----------------------------------------------------

    def on_insert(self, eid: int, fingerprint: int = 0) -> None:
        """Track ``eid`` in ``M`` if ``fingerprint`` is a ghost hit, else in ``S``."""
        check_new_eid(eid)
        if eid >= self._queue.shape[0]:
            cap = grown_capacity(self._queue.shape[0], eid)
            self._prev = grow_array(self._prev, cap, _NIL)
            self._next = grow_array(self._next, cap, _NIL)
            self._queue = grow_array(self._queue, cap, _NONE)
            self._freq = grow_array(self._freq, cap, 0)
            self._fp = grow_array(self._fp, cap, 0)
        elif self._queue[eid] != _NONE:
            raise ValueError(f"entry {eid} is already tracked")
        fp = fingerprint & _FP_MASK
        self._fp[eid] = fp
        self._freq[eid] = 0
        ghost_hit = fp != 0 and self._ghost.discard(fp)
        self._push_head(_MAIN if ghost_hit else _SMALL, eid)

    def on_access(self, eid: int) -> None:
        """Bump the 2-bit frequency of ``eid``."""
        if self._tracked(eid) and self._freq[eid] < _MAX_FREQ:
            self._freq[eid] += 1

    def on_access_many(self, eids: Sequence[int] | np.ndarray) -> None:
        """``on_access`` of each id, in a few numpy calls: bumps commute, so k hits on one id add min(k, room)."""
        ids = np.asarray(eids, dtype=np.int64)
        if ids.shape[0] < _BATCH_MIN:
            on_access = self.on_access
            for eid in ids.tolist():
                on_access(eid)
            return
        queue, freq = self._queue, self._freq
        ids = ids[(ids >= 0) & (ids < queue.shape[0])]
        ids = np.sort(ids[queue[ids] != _NONE])
        if (ids[1:] == ids[:-1]).any():
            ids, hits = np.unique(ids, return_counts=True)
            freq[ids] = np.minimum(freq[ids] + hits, _MAX_FREQ)
        else:
            freq[ids] = np.minimum(freq[ids] + 1, _MAX_FREQ)

    def on_remove(self, eid: int) -> None:
        """Unlink ``eid`` from its queue; not recorded in the ghost."""
        if self._tracked(eid):
            self._unlink(eid)

    def choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        """Run S3-FIFO eviction, skipping ineligible entries."""
        n_small, n_main = self._qsize[_SMALL], self._qsize[_MAIN]
        if n_small == 0 and n_main == 0:
            return None
        if n_small > 0 and (n_small >= self._small_fraction * (n_small + n_main) or n_main == 0):
            victim = self._evict_small(eligible)
            return victim if victim is not None else self._evict_main(eligible)
        victim = self._evict_main(eligible)
        if victim is not None:
            return victim
        main_before = self._qsize[_MAIN]
        victim = self._evict_small(eligible)
        if victim is None and self._qsize[_MAIN] != main_before:
            # Promotions from S may have brought eligible entries into M.
            victim = self._evict_main(eligible)
        return victim

    def _evict_small(self, eligible: Callable[[int], bool]) -> int | None:
        """Examine each S entry at most once, tail first."""
        for _ in range(self._qsize[_SMALL]):
            eid = self._qtail[_SMALL]
            self._unlink(eid)
            if self._freq[eid] > 0:
                self._freq[eid] = 0
                self._push_head(_MAIN, eid)
            elif eligible(eid):
                fp = int(self._fp[eid])
                if fp != 0:
                    self._ghost.add(fp, self._ghost_limit())
                return eid
            else:
                self._push_head(_SMALL, eid)
        return None

    def _evict_main(self, eligible: Callable[[int], bool]) -> int | None:
        """CLOCK over M: at most 4 rotations, fewer when nothing decays."""
        while True:
            decayed = False
            for _ in range(self._qsize[_MAIN]):
                eid = self._qtail[_MAIN]
                self._unlink(eid)
                freq = self._freq[eid]
                if freq > 0:
                    self._freq[eid] = freq - 1
                    decayed = True
                elif eligible(eid):
                    return eid
                self._push_head(_MAIN, eid)
            if not decayed:
                return None

    def __len__(self) -> int:
        return self._qsize[_SMALL] + self._qsize[_MAIN]

    def order(self) -> list[int]:
        """The small FIFO's oldest first, then the main FIFO's (see EvictionPolicy.order). A successor inserts
        them all into its small FIFO: which queue each was in, its frequency and the ghost are not carried."""
        out: list[int] = []
        for q in (_SMALL, _MAIN):
            eid = self._qtail[q]
            while eid != _NIL:
                out.append(eid)
                eid = int(self._prev[eid])
        return out

    def __contains__(self, eid: object) -> bool:
        return isinstance(eid, (int, np.integer)) and self._tracked(int(eid))

    def memory_bytes(self) -> int:
        """18 bytes per capacity slot; the ghost is excluded (see ``ghost_memory_bytes``)."""
        arrays = (self._prev, self._next, self._queue, self._freq, self._fp)
        return int(sum(a.nbytes for a in arrays))

    def ghost_memory_bytes(self) -> int:
        """Estimated bytes of the bounded ghost (ring + dict)."""
        return self._ghost.memory_bytes()

    @property
    def small_len(self) -> int:
        """Entries in the small FIFO (for metrics)."""
        return self._qsize[_SMALL]

    @property
    def main_len(self) -> int:
        """Entries in the main FIFO (for metrics)."""
        return self._qsize[_MAIN]

    @property
    def ghost_len(self) -> int:
        """Fingerprints currently remembered by the ghost (for metrics)."""
        return len(self._ghost)
