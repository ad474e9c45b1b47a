"""Engine methods that remove or pin blocks across tiers: Delete, ClearNamespace, Pin (a mixin of `Engine`).

Under the engine's one lock like the rest; disk-tier index writes happen after it is released. A block being
read (leased) is DOOMED rather than freed: its slot is freed when the last lease goes (engine._unlease), so
a reader never sees its bytes reused. A block being promoted from disk is cancelled: the promoter frees the
slot when its read returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.engine.catalog import EntryState
from kvstore.engine.events import REMOVED
from kvstore.engine.tiering import TIER_DISK, TIER_RAM

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

__all__ = ["ManagementMixin"]

_COMMITTED = int(EntryState.COMMITTED)
_DOOMED = int(EntryState.DOOMED)
_PROMOTING = int(EntryState.PROMOTING)


class ManagementMixin:
    def delete(self: Engine, ns_name: str, keys: Sequence[bytes]) -> int:
        """Remove keys from every tier; returns how many were present anywhere."""
        self._check_keys(keys)
        with self._lock:
            ns = self._namespace(ns_name)
            in_ram = [self._delete_one(ns.index.get(k)) for k in keys]
            on_disk = self._disk.contains_many(ns.name, keys) if self._disk is not None else [0] * len(keys)
        if self._disk is not None and any(on_disk):
            gone = [k for k, d in zip(keys, on_disk) if d]
            self._disk.delete(ns.name, gone)  # index I/O: outside the lock
            self.events.publish(REMOVED, ns.name, gone, TIER_DISK)
        return sum(1 for r, d in zip(in_ram, on_disk) if r or d)

    def _delete_one(self: Engine, eid: int | None) -> int:
        cat = self._cat
        if eid is not None and cat.state[eid] == _PROMOTING:
            self._promotions[eid].cancelled = True  # the promoter frees the slot when its read returns
            cat.unindex(eid)
            return 1
        if eid is None or cat.state[eid] != _COMMITTED:
            return 0
        self._touches.apply()
        self._policy.on_remove(eid)
        if self.events.subscribers:
            self.events.publish(REMOVED, cat.namespace_of(eid).name, [cat.keys[eid]], TIER_RAM)
        self._forget_committed(eid)
        self.counters.deleted_blocks += 1
        if cat.leases[eid] > 0:
            cat.state[eid] = _DOOMED
        else:
            self._free(eid)
        return 1

    def clear_namespace(self: Engine, ns_name: str) -> int:
        """Delete every block of a namespace in every tier; returns how many distinct keys went."""
        with self._lock:
            ns = self._namespace(ns_name)
            ram_keys = {k for k, e in list(ns.index.items()) if self._delete_one(e)}
        if self._disk is None:
            return len(ram_keys)
        self.events.publish(REMOVED, ns.name, [], TIER_DISK, whole_namespace=True)
        both = sum(1 for n in self._disk.contains_many(ns.name, list(ram_keys)) if n) if ram_keys else 0
        return len(ram_keys) + self._disk.clear_namespace(ns.name) - both

    def pin(self: Engine, ns_name: str, keys: Sequence[bytes], delta: int) -> int:
        """delta=+1 pins, -1 unpins; returns how many keys changed (unpin of an unpinned key changes none)."""
        self._check_keys(keys)
        with self._lock:
            index, cat = self._namespace(ns_name).index, self._cat
            changed = 0
            for key in keys:
                eid = index.get(key)
                if eid is None or cat.state[eid] != _COMMITTED:
                    continue
                pins = int(cat.pins[eid]) + delta
                if 0 <= pins <= 0xFFFF:
                    cat.pins[eid] = pins
                    changed += 1
            return changed
