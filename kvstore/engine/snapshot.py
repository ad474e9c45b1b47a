"""Read-only views of the engine's state for Stats, ListKeys and Describe (called under the engine lock).

Kept apart from the engine because none of it changes state: it turns catalog columns and allocator counts
into the value objects that the service sends. Stats is O(entries) (vectorized over the columns); it is
meant for inspection and metrics scrapes, not for the hot path.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvstore.arena.allocator import SlabAllocator
from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.engine.results import EngineConfig, EngineStats, KeyRecord, NamespaceStats

__all__ = ["snapshot", "key_record"]

_COMMITTED = int(EntryState.COMMITTED)
_RESERVED = int(EntryState.RESERVED)
# NamespaceStats' fields the catalog's Namespace keeps under the same name (disk_bytes comes from the disk tier)
_NAMESPACE_FIELDS = tuple(f.name for f in dataclasses.fields(NamespaceStats)
                          if f.name in {g.name for g in dataclasses.fields(Namespace)})


def key_record(cat: Catalog, key: bytes, eid: int) -> KeyRecord:
    age = max(0.0, cat.now() - float(cat.created[eid]))
    return KeyRecord(key, int(cat.size[eid]), "ram", age, int(cat.pins[eid]), int(cat.leases[eid]),
                     int(cat.checksum[eid]))


def snapshot(cat: Catalog, alloc: SlabAllocator, policy: str, config: EngineConfig, leases_active: int,
             reservations_active: int, counters: dict[str, int]) -> EngineStats:
    ids = cat.live_ids()
    state, sizes = cat.state[ids], cat.size[ids]
    committed = state == _COMMITTED
    stored = int(sizes[committed].sum())
    classes = np.asarray(alloc.classes, dtype=np.int64)
    slot = classes[np.searchsorted(classes, sizes)] if len(ids) else np.zeros(0, np.int64)
    allocated = alloc.allocated_bytes
    return EngineStats(
        policy=policy,
        capacity_bytes=alloc.capacity,
        slab_bytes=alloc.slab_bytes,
        slabs_total=alloc.n_slabs,
        slabs_free=alloc.free_slabs,
        allocated_bytes=allocated,
        stored_bytes=stored,
        reserved_bytes=int(slot[state == _RESERVED].sum()),
        leased_bytes=int(sizes[cat.leases[ids] > 0].sum()),
        pinned_bytes=int(sizes[(cat.pins[ids] > 0) & committed].sum()),
        fragmentation=(1.0 - stored / allocated) if allocated and stored else 0.0,
        stranded_bytes=alloc.assigned_bytes() - allocated,
        blocks=int(committed.sum()),
        leases_active=leases_active,
        reservations_active=reservations_active,
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        counters=counters,
        namespaces=[NamespaceStats(**{f: getattr(n, f) for f in _NAMESPACE_FIELDS}) for n in cat.namespaces],
        size_classes=alloc.usage(),
    )
