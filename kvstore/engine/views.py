"""Read-only views across tiers: ListKeys pages, Describe records, Stats (no state changes here).

Each view has a RAM half, called under the engine's lock (it reads the catalog and the allocator), and a disk
half, called after the lock is released: the DiskStore has its own lock and its index reads may wait on I/O.
The value objects come from snapshot.py (RAM) and the disk tier's own records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.engine.config import EngineConfig
from kvstore.engine.counters import Counters
from kvstore.engine.leases import LeaseTable
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.reservations import ReservationTable
from kvstore.engine.results import EngineStats, KeyRecord
from kvstore.engine.snapshot import key_record, snapshot
from kvstore.tiers.disk import DiskStore

__all__ = ["Views"]

_COMMITTED = int(EntryState.COMMITTED)


class Views:
    """ListKeys, Describe and Stats: `ram_*` under the engine's lock, the rest without it."""

    def __init__(self, config: EngineConfig, cat: Catalog, ram: RamSpace, leases: LeaseTable,
                 reservations: ReservationTable, disk: DiskStore | None, counters: Counters) -> None:
        self._config = config
        self._cat = cat
        self._ram = ram
        self._leases = leases
        self._reservations = reservations
        self._disk = disk
        self._counters = counters

    # -- ListKeys ---------------------------------------------------------------------------------------
    def ram_page(self, ns: Namespace, cursor: bytes, limit: int) -> tuple[dict[bytes, KeyRecord], bool]:
        """Under the lock: the first `limit` committed RAM keys after `cursor`, and whether more follow."""
        cat = self._cat
        ram = sorted((k, e) for k, e in ns.index.items() if cat.state[e] == _COMMITTED and k > cursor)
        return {k: key_record(cat, k, e) for k, e in ram[:limit]}, len(ram) > limit

    def ram_keys(self, ns: Namespace) -> list[bytes]:
        """Under the lock: every key committed in RAM, unordered."""
        state = self._cat.state
        return [k for k, e in ns.index.items() if state[e] == _COMMITTED]

    def page(self, ns_name: str, records: dict[bytes, KeyRecord], ram_more: bool, cursor: bytes,
             limit: int) -> tuple[list[KeyRecord], bytes]:
        """No lock: merge the disk tier's page into `ram_page`'s; one page in byte order and the next cursor
        (b"" at the end)."""
        disk_more = False
        if self._disk is not None:
            page, next_cursor = self._disk.list_keys(ns_name, cursor, limit)
            disk_more = bool(next_cursor)
            for r in page:
                mine = records.get(r.key)
                records[r.key] = (dataclasses.replace(mine, tier="ram+disk") if mine is not None
                                  else KeyRecord(r.key, r.length, "disk", 0.0, 0, 0, r.checksum))
        keys = sorted(records)
        more = ram_more or disk_more or len(keys) > limit
        keys = keys[:limit]
        return [records[k] for k in keys], (keys[-1] if more and keys else b"")

    # -- Describe ---------------------------------------------------------------------------------------
    def ram_records(self, ns: Namespace, keys: Sequence[bytes]) -> dict[bytes, KeyRecord]:
        """Under the lock: records of the keys committed in RAM."""
        index, cat = ns.index, self._cat
        return {k: key_record(cat, k, e) for k in keys if (e := index.get(k)) is not None and cat.state[e] == _COMMITTED}

    def describe(self, ns_name: str, keys: Sequence[bytes], ram: dict[bytes, KeyRecord]) -> list[KeyRecord]:
        """No lock: records of the present keys among `keys` (any tier), in request order."""
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

    # -- Stats ------------------------------------------------------------------------------------------
    def ram_stats(self) -> EngineStats:
        """Under the lock: the RAM tier's stats and every counter (O(entries), vectorized)."""
        alloc = self._ram.allocator
        counters = self._counters.snapshot()
        counters.update(slab_binds=alloc.binds, slab_bind_failures=alloc.bind_failures)
        return snapshot(self._cat, alloc, self._ram.policy.name, self._config, len(self._leases),
                        len(self._reservations), counters)

    def with_disk(self, st: EngineStats) -> EngineStats:
        """No lock: add the disk tier's stats and each namespace's footprint there."""
        if self._disk is not None:
            st.disk = self._disk.stats()
            on_disk = self._disk.namespace_bytes()
            st.namespaces = [dataclasses.replace(n, disk_bytes=on_disk.get(n.name, 0)) for n in st.namespaces]
        return st
