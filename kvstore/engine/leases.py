"""The lease table: which readers hold which RAM entries, and until when.

A lease is a batch of entry ids a reader may copy from; each holds its entries (the catalog's `leases`
column counts holders per entry), and a held entry is never evicted or reused. A lease that outlives its TTL
is dropped by the sweeper; a reader that copied past that point sees the slot's generation changed and
treats its copy as a miss. Other holders use the same column without a lease id: the disk writer holds a
slot while its write runs (disk_link.py), a get holds its RAM hits while it waits for promotions.

A DOOMED entry (deleted while held) is freed when its last holder lets go. Called under the engine's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvstore.engine.catalog import Catalog, EntryState
from kvstore.engine.counters import Counters
from kvstore.engine.ttl import TtlTable

__all__ = ["LeaseTable"]

_DOOMED = int(EntryState.DOOMED)
_ONE = np.int32(1)  # the leases column's dtype: np.add.at stays on its fast path (~1 us for 280 ids, not ~16)


class LeaseTable:
    """Leases by id (TTL-bounded) and the per-entry hold counts. Called under the engine's lock."""

    def __init__(self, cat: Catalog, ttl_s: float, free: Callable[[int], None], counters: Counters) -> None:
        self._cat = cat
        self._table: TtlTable[np.ndarray] = TtlTable(ttl_s)
        self._free = free  # RamSpace.free: a DOOMED entry's slot goes back at its last release
        self._counters = counters
        self.expires_in_ms = int(ttl_s * 1000)

    def hold(self, ids: np.ndarray) -> None:
        """One more holder on each entry (an id listed twice is held twice)."""
        np.add.at(self._cat.leases, ids, _ONE)

    def grant(self, ids: np.ndarray) -> int:
        """A lease id for entries already held (`hold`); `release` or expiry lets them go."""
        return self._table.add(ids)

    def unhold(self, ids: np.ndarray) -> None:
        """One holder fewer on each entry; DOOMED entries left without holders are freed."""
        cat = self._cat
        np.subtract.at(cat.leases, ids, _ONE)
        for eid in ids[cat.state[ids] == _DOOMED].tolist():
            if cat.leases[eid] == 0 and cat.state[eid] == _DOOMED:
                self._free(eid)

    def release(self, lease_ids: Sequence[int]) -> int:
        """End leases; returns how many were live (unknown or expired ids are ignored)."""
        released = 0
        for lid in lease_ids:
            ids = self._table.pop(lid)
            if ids is not None:
                self.unhold(ids)
                released += 1
        return released

    def expire(self, now: float) -> None:
        """Drop the leases whose TTL has passed (counted)."""
        for _, ids in self._table.expire(now):
            self._counters.lease_expirations += 1
            self.unhold(ids)

    def note_checksums(self, lease_id: int, offsets: Sequence[int], checksums: Sequence[int]) -> int:
        """Set the checksum of the lease's entries at `offsets` that have none (0); how many were set. By
        offset, not position: the caller knows its hits by where they sit. A live lease holds its entries, so
        each offset is still the block the caller hashed; an expired or unknown lease sets nothing."""
        ids = self._table.get(lease_id)
        if ids is None:
            return 0
        cat = self._cat
        by_offset = dict(zip(cat.offset[ids].tolist(), ids.tolist()))
        n = 0
        for off, digest in zip(offsets, checksums):
            eid = by_offset.get(off)
            if eid is not None and digest and not cat.checksum[eid]:
                cat.checksum[eid] = digest
                n += 1
        return n

    def live(self, now: float) -> list[tuple[int, np.ndarray, float]]:
        """(lease id, entry ids, seconds left) of every live lease (a hand-over carries them)."""
        return self._table.live(now)

    @property
    def next_id(self) -> int:
        return self._table.next_id

    def restore(self, lease_id: int, ids: np.ndarray, seconds_left: float, next_id: int = 0) -> None:
        """A previous daemon's lease on entries already placed here: held again, same id, same deadline."""
        self.hold(ids)
        self._table.restore(lease_id, ids, seconds_left, next_id)

    def continue_ids(self, next_id: int) -> None:
        self._table.next_id = next_id

    def namespace_of(self, lease_id: int) -> str | None:
        """The namespace a live lease reads from (None: unknown, expired or empty)."""
        ids = self._table.get(lease_id)
        if ids is None or not len(ids):
            return None
        return self._cat.namespace_of(int(ids[0])).name

    def __len__(self) -> int:
        return len(self._table)
