"""Read-only questions to the engine across tiers: listings, key records, stats (a mixin of `Engine`).

Nothing here changes state. Disk-tier index reads happen outside the engine lock (the DiskStore has its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.engine.catalog import EntryState
from kvstore.engine.results import EngineStats, KeyRecord
from kvstore.engine.snapshot import key_record, snapshot
from kvstore.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

__all__ = ["InspectionMixin"]

_COMMITTED = int(EntryState.COMMITTED)


class InspectionMixin:
    def list_keys(self: Engine, ns_name: str, cursor: bytes, limit: int) -> tuple[list[KeyRecord], bytes]:
        """One page of keys after `cursor` across tiers, in byte order, and the next cursor (b"" at the end)."""
        if not 1 <= limit <= 10000:
            raise InvalidRequestError(f"limit {limit} out of range: use 1..10000")
        with self._lock:
            ns, cat = self._namespace(ns_name), self._cat
            ram = sorted((k, e) for k, e in ns.index.items() if cat.state[e] == _COMMITTED and k > cursor)
            ram_more = len(ram) > limit
            records = {k: key_record(cat, k, e) for k, e in ram[:limit]}
        disk_more = False
        if self._disk is not None:
            page, next_cursor = self._disk.list_keys(ns.name, cursor, limit)
            disk_more = bool(next_cursor)
            for r in page:
                mine = records.get(r.key)
                records[r.key] = (dataclasses.replace(mine, tier="ram+disk") if mine is not None
                                  else KeyRecord(r.key, r.length, "disk", 0.0, 0, 0, r.checksum))
        keys = sorted(records)
        more = ram_more or disk_more or len(keys) > limit
        keys = keys[:limit]
        return [records[k] for k in keys], (keys[-1] if more and keys else b"")

    def describe(self: Engine, ns_name: str, keys: Sequence[bytes]) -> list[KeyRecord]:
        """Records of the present keys among `keys` (any tier), in request order."""
        self._check_keys(keys)
        with self._lock:
            index, cat = self._namespace(ns_name).index, self._cat
            ram = {k: key_record(cat, k, e) for k in keys if (e := index.get(k)) is not None and cat.state[e] == _COMMITTED}
        out: list[KeyRecord] = []
        for k in keys:
            rec = ram.get(k)
            disk = self._disk.lookup(ns_name, k) if self._disk is not None else None
            if rec is not None and disk is not None:
                rec = dataclasses.replace(rec, tier="ram+disk")
            elif disk is not None:
                rec = KeyRecord(k, disk.length, "disk", 0.0, 0, 0, disk.checksum)
            if rec is not None:
                out.append(rec)
        return out


    # -- reporting ---------------------------------------------------------------------------------------
    def stats(self: Engine) -> EngineStats:
        with self._lock:
            counters = self.counters.snapshot()
            counters.update(slab_binds=self._alloc.binds, slab_bind_failures=self._alloc.bind_failures)
            st = snapshot(self._cat, self._alloc, self._policy.name, self.config, len(self._leases),
                          len(self._reservations), counters)
        if self._disk is not None:
            st.disk = self._disk.stats()
            on_disk = self._disk.namespace_bytes()
            st.namespaces = [dataclasses.replace(n, disk_bytes=on_disk.get(n.name, 0)) for n in st.namespaces]
        return st

    @property
    def disk_enabled(self: Engine) -> bool:
        return self._disk is not None

    @property
    def disk_directory(self: Engine) -> str:
        return self._disk.config.directory if self._disk is not None else ""

    @property
    def write_queue_blocks(self: Engine) -> int:
        return self._mover.queued_writes if self._mover is not None else 0

    @property
    def admission_name(self: Engine) -> str:
        return self._admission.name

    def disk_degraded_reason(self: Engine) -> str:
        """Why the disk tier is degraded ('' when healthy or absent): Health reports it."""
        if self._disk is None or not self._disk.degraded:
            return ""
        return self._disk.stats().degraded_reason or "disk tier degraded"
