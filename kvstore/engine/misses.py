"""Why a key is missing: a bounded ledger of keys that left the store, and the cause of a prefix Lookup's miss.

A scheduler asking "why did this request miss" needs, for the first block not found, one cause. The engine
knows it only at the moment a block leaves, so it writes that moment down here:

    evicted         RAM eviction of a block with no disk copy (by the engine's eviction policy)
    disk_reclaimed  its last copy dropped by the disk tier's segment reclamation
    deleted         a Delete removed it, or a Release hint let go of its disk copy
    cleared         a namespace Clear (recorded once per namespace with its time, never per key)

and when a key is absent with no record, the cause is one of:

    other_namespace absent here but held now (in RAM) by another namespace: the model, layout, cache_salt or
                    key seed differ (the keys match, the namespace does not)
    never_stored    nothing known: never stored here, or its record was forgotten (the ledger is bounded)
    load_failed     present in a tier, but not served: its promotion from disk failed, timed out or found no
                    room (a miss the ledger cannot explain because nothing left)

Memory: one OrderedDict entry per key (the 2-byte namespace id + the key as one bytes object -> an int packing
the time in ms and the cause), about 150-200 bytes each for 16-64 byte keys; the oldest record is forgotten
first once `capacity` keys are held. A key stored again leaves the ledger. A Clear is one record per namespace:
a key absent after it, with no later record of its own, is reported "cleared" (including one that was never
stored before the Clear: the ledger does not know which keys the namespace held). Capacity 0 disables it (no
record is kept; every miss is then never_stored, other_namespace or load_failed).

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.vocab import Tier

__all__ = ["MissLedger", "KeyExplanation", "CAUSES", "COUNTER_OF", "EVICTED", "DISK_RECLAIMED", "DELETED",
           "CLEARED", "NEVER_STORED", "OTHER_NAMESPACE", "LOAD_FAILED"]

EVICTED, DISK_RECLAIMED, DELETED, CLEARED = "evicted", "disk_reclaimed", "deleted", "cleared"
NEVER_STORED, OTHER_NAMESPACE, LOAD_FAILED = "never_stored", "other_namespace", "load_failed"

#: every cause a miss is counted under, in the order Stats and /metrics list them
CAUSES: tuple[str, ...] = (NEVER_STORED, EVICTED, DISK_RECLAIMED, DELETED, CLEARED, OTHER_NAMESPACE, LOAD_FAILED)
#: cause -> its engine counter (kvstore/engine/counters.py)
COUNTER_OF: dict[str, str] = {c: "misses_" + c for c in CAUSES}

_RECORDED = (EVICTED, DISK_RECLAIMED, DELETED, CLEARED)  # the causes a record holds (index = its code)
_CODE = {c: i for i, c in enumerate(_RECORDED)}
_CODE_BITS = 2


@dataclass(frozen=True)
class KeyExplanation:
    """Where one key lives now, or why it is not here (Engine.explain)."""

    tier: Tier                              # where it lives now in this namespace; Tier.NONE when absent
    cause: str = ""                         # one of CAUSES when absent ("" when present)
    age_s: float = 0.0                      # seconds since it left (a recorded cause; 0.0 otherwise)
    policy: str = ""                        # the eviction policy, for "evicted"
    other_namespaces: tuple[str, ...] = ()  # namespaces holding this key now (in RAM), when absent here


class MissLedger:
    """(namespace id, key) -> when and why it left, at most `capacity` keys, oldest forgotten first."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 0:
            raise ValueError(f"miss ledger capacity {capacity} must be >= 0")
        self.capacity = capacity
        self.clock = clock  # monotonic seconds; tests pass their own to read exact ages
        self._left: OrderedDict[bytes, int] = OrderedDict()
        self._cleared: dict[int, int] = {}  # namespace id -> time of its last Clear (ms)

    def __len__(self) -> int:
        return len(self._left)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def _now_ms(self) -> int:
        return round(self.clock() * 1000)

    def left(self, ns_id: int, keys: Iterable[bytes], cause: str) -> None:
        """Keys of one namespace that left the store now, for `cause` (evicted, disk_reclaimed, deleted)."""
        if not self.capacity:
            return
        value = (self._now_ms() << _CODE_BITS) | _CODE[cause]
        prefix = ns_id.to_bytes(2, "little")
        entries = self._left
        for key in keys:
            k = prefix + key
            entries.pop(k, None)  # a newer record goes to the end (newest)
            entries[k] = value
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def stored(self, ns_id: int, keys: Iterable[bytes]) -> None:
        """Keys stored again: their records go (they are present; a later removal writes a new one)."""
        entries = self._left
        if not entries:
            return
        prefix = ns_id.to_bytes(2, "little")
        for key in keys:
            entries.pop(prefix + key, None)

    def cleared(self, ns_id: int) -> None:
        """A Clear of the namespace, now: one record for all its keys."""
        if self.capacity:
            self._cleared[ns_id] = self._now_ms()

    def why(self, ns_id: int, key: bytes) -> tuple[str, float] | None:
        """(cause, seconds since) of the latest record of an absent key; None when nothing is recorded."""
        value = self._left.get(ns_id.to_bytes(2, "little") + key)
        clear_ms = self._cleared.get(ns_id)
        if value is not None and (clear_ms is None or value >> _CODE_BITS >= clear_ms):
            cause, at_ms = _RECORDED[value & ((1 << _CODE_BITS) - 1)], value >> _CODE_BITS
        elif clear_ms is not None:
            cause, at_ms = CLEARED, clear_ms
        else:
            return None
        return cause, max(0, self._now_ms() - at_ms) / 1000
