"""The engine's link to the disk tier: admission, write-behind, promotions, and the mover's hooks.

Write-behind: a block is queued for the disk writer when the admission policy accepts its use count (at
commit, or when a later hit raises the count). Its slot is held (leases + 1) only while the write runs. A
commit's blocks are queued in the commit's order (the order of the chain), not by entry id: the disk tier
appends them in that order, so a prefix chain lands in one segment (or consecutive ones) and ages out together.

Promotion: a Lookup that finds a key only on disk allocates a slot (PROMOTING entry) and queues a read into it;
the promoter commits the entry when the read lands, or frees the slot when it failed or was cancelled.

Reclamation: the disk writer reports the blocks whose record a segment reclamation dropped (the disk tier's
second chance keeps those read since their write, see kvstore/tiers/disk/reclaim.py). A RAM copy of such a
block loses its ON_DISK mark (DISK_DROPPED: its eviction now drops the block, and is published as removed
from RAM, not moved to disk), and each is published as removed from the disk tier.

Locking: methods are called under the engine's lock, except the four MoverHooks (claim_writes, finish_writes,
finish_reclaim, finish_promotion), which the mover's threads call with no lock held: they take the engine's
lock themselves; and `probe_if_due`, `start`, `stop`, which run outside it (they do I/O or join threads).
DiskStore calls made under the lock are index reads (one lmdb read txn per batch).
With no disk tier every method is a cheap no-op (or says "nothing on disk").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvstore.engine.catalog import DISK_DROPPED, ON_DISK, QUEUED, WRITING, Catalog, EntryState, Namespace
from kvstore.engine.counters import Counters
from kvstore.engine.engine_lock import EngineLock
from kvstore.engine.events import MOVED, REMOVED, STORED, EventBus
from kvstore.engine.leases import LeaseTable
from kvstore.engine.misses import DISK_RECLAIMED, MissLedger
from kvstore.engine.movement import Mover, Promotion
from kvstore.engine.ram_space import RamSpace
from kvstore.policies.admission import AdmissionPolicy, AlwaysAdmit
from kvstore.tiers.disk import DiskStatus, DiskStore, WriteItem
from kvstore.vocab import Tier

__all__ = ["DiskLink"]

_COMMITTED = int(EntryState.COMMITTED)
_PROMOTING = int(EntryState.PROMOTING)
_DOOMED = int(EntryState.DOOMED)


class DiskLink:
    """What the engine does with the disk tier, and the hooks its mover calls back (kvstore.engine.movement).

    Called under the engine's lock, but for the MoverHooks (which take it) and start/stop/probe_if_due/delete
    (which run without it: see the module docstring)."""

    def __init__(self, store: DiskStore | None, admission: AdmissionPolicy | None, *, cat: Catalog,
                 ram: RamSpace, leases: LeaseTable, counters: Counters, events: EventBus, lock: EngineLock,
                 arena_address: int = 0, queue_blocks: int = 4096, misses: MissLedger | None = None) -> None:
        self.store = store
        self.admission = admission or AlwaysAdmit()
        self._cat = cat
        self._ram = ram
        self._leases = leases
        self._counters = counters
        self._events = events
        self._lock = lock  # the engine's: taken by the hooks only
        self._misses = misses if misses is not None else MissLedger(0)  # reclaimed keys with no RAM copy go in
        self._arena_address = arena_address
        self._promotions: dict[int, Promotion] = {}
        self.mover = Mover(store, self, queue_blocks=queue_blocks) if store is not None else None
        self._queue_blocks = queue_blocks
        self._left: list[tuple[int, int, bytes]] = []  # writes a hand-over left queued (restart re-queues them)
        self._next_probe = 0.0
        self.on_written: Callable[[list[int]], None] | None = None  # hints.py: after each batch, under the lock
        self.on_promoted: Callable[[int, bool], None] | None = None  # hints.py: (entry, landed), under the lock

    # -- outside the lock -------------------------------------------------------------------------------
    def start(self) -> None:
        if self.mover is not None:
            self.mover.start()

    def stop(self) -> None:
        if self.mover is not None:
            self.mover.stop()

    def stop_for_handover(self) -> int:
        """Stop the I/O threads leaving the queued writes (kept here for `restart`); how many were left."""
        if self.mover is None:
            return 0
        self._left = self.mover.stop(leave_writes=True)
        return len(self._left)

    def restart(self) -> None:
        """After stop_for_handover, when the hand-over failed: new I/O threads, the writes left queued again."""
        if self.store is None:
            return
        self.mover = Mover(self.store, self, queue_blocks=self._queue_blocks)
        self.mover.start()
        left, self._left = self._left, []
        if left:
            self.mover.enqueue_writes(left)

    def probe_if_due(self, now: float, interval_s: float) -> None:
        """Retry a degraded disk tier, at most once per `interval_s` (it does I/O: never under the lock)."""
        if self.store is not None and self.store.degraded and now >= self._next_probe:
            self._next_probe = now + interval_s
            self.store.probe()

    def delete(self, ns_name: str, keys: list[bytes]) -> None:
        """Remove keys known to be on disk (index writes: outside the lock)."""
        if self.store is not None and keys:
            self.store.delete(ns_name, keys)
            self._events.publish(REMOVED, ns_name, keys, Tier.DISK)

    @property
    def queued_writes(self) -> int:
        return self.mover.queued_writes if self.mover is not None else 0

    # -- under the engine's lock ------------------------------------------------------------------------
    def contains_many(self, ns_name: str, keys: Sequence[bytes]) -> list[int]:
        """Stored length of each key on disk (0: absent); all 0 without a disk tier."""
        return self.store.contains_many(ns_name, keys) if self.store is not None else [0] * len(keys)

    def on_commit(self, eids: list[int]) -> None:
        """A commit's blocks have been used once: queue them if admission takes a first use."""
        if self.store is not None:
            ids = np.array(eids, dtype=np.int64)
            self._cat.seen[ids] = 1
            if self.admission.admits(1):
                self.queue_writes(ids)

    def note_hits(self, ids: np.ndarray) -> None:
        """Raise the use counts of RAM hits; queue the ones that just became admissible."""
        if self.store is None or not len(ids):
            return
        cat = self._cat
        seen = cat.seen[ids]
        cat.seen[ids] = np.minimum(seen.astype(np.int16) + 1, 255)
        newly = ids[(cat.seen[ids] >= self.admission.threshold) & (cat.flags[ids] == 0)]
        self.queue_writes(newly)

    def queue_writes(self, ids: np.ndarray) -> None:
        if self.mover is None or not len(ids):
            return
        cat = self._cat
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # each once, in the caller's (chain) order
        items = [(int(e), int(cat.ns[e]), cat.keys[e]) for e in ids.tolist()]
        accepted = self.mover.enqueue_writes(items)
        cat.flags[ids[:accepted]] |= QUEUED
        self._counters.demote_queue_full += len(items) - accepted

    def promotion(self, eid: int) -> Promotion | None:
        """The promotion in flight into entry `eid` (a PROMOTING entry), to join."""
        return self._promotions.get(eid)

    def start_promotion(self, ns: Namespace, key: bytes, length: int, keep: set[int]) -> Promotion | None:
        """Allocate a slot (never evicting `keep`) and queue the read of `key` into it; None: no room."""
        off = self._ram.allocate(length, keep, ns.tenant)
        if off is None:
            self._counters.promotion_failures += 1
            return None
        assert self.mover is not None  # a key found on disk means there is a disk tier
        cat = self._cat
        eid = cat.add(ns, key, off, length)
        cat.state[eid] = _PROMOTING
        cat.flags[eid] = ON_DISK
        p = Promotion(eid, ns.name, key, self._arena_address + off, self._ram.slot_bytes(length))
        self._promotions[eid] = p
        self.mover.enqueue_promotion(p)
        self._counters.promotions += 1
        return p

    def cancel_promotion(self, eid: int) -> None:
        """Deleted while being promoted: the promoter frees the slot when its read returns."""
        self._promotions[eid].cancelled = True
        self._cat.unindex(eid)

    # -- MoverHooks: called from the mover's threads, no lock held --------------------------------------
    def claim_writes(self, batch: list[tuple[int, int, bytes]]) -> tuple[list[WriteItem], list[int]]:
        """Writer thread: turn queued entries that still exist into write items and hold their slots."""
        items: list[WriteItem] = []
        eids: list[int] = []
        with self._lock:
            cat = self._cat
            for eid, ns_id, key in batch:
                live = (eid < len(cat.keys) and cat.state[eid] == _COMMITTED and int(cat.ns[eid]) == ns_id
                        and cat.keys[eid] == key and cat.flags[eid] & QUEUED)
                if not live:
                    self._counters.demote_dropped += 1  # evicted or deleted before the writer got to it
                    continue
                cat.flags[eid] = WRITING  # not 0: a hit meanwhile must not queue it again
                cat.leases[eid] += 1
                ns = cat.namespaces[ns_id]
                items.append(WriteItem(ns.name, key, self._arena_address + int(cat.offset[eid]), int(cat.size[eid]),
                                       ns.disk_codec))
                eids.append(eid)
        return items, eids

    def finish_writes(self, eids: list[int], statuses: list[DiskStatus]) -> list[tuple[str, bytes]]:
        """Writer thread: record results; returns (namespace, key) of blocks deleted during their write."""
        stale: list[tuple[str, bytes]] = []
        with self._lock:
            cat = self._cat
            for eid, status in zip(eids, statuses):
                cat.flags[eid] = 0  # a failed write may be retried by a later hit (admission runs again)
                if status is DiskStatus.OK:
                    cat.flags[eid] = ON_DISK
                    self._counters.disk_writes += 1
                    self._events.publish(STORED, cat.namespace_of(eid).name, [cat.keys[eid]], Tier.DISK)  # type: ignore[list-item]  # a live entry's key is set (None only once dropped)
                else:
                    self._counters.disk_write_failures += 1
                if cat.state[eid] == _DOOMED:
                    stale.append((cat.namespace_of(eid).name, cat.keys[eid]))  # type: ignore[arg-type]  # a live entry's key is set (None only once dropped)
            if eids:
                self._leases.unhold(np.array(eids, dtype=np.int64))
                if self.on_written is not None:
                    self.on_written(eids)
        return stale

    def finish_reclaim(self, dropped: list[tuple[str, bytes]], reinserted: int) -> None:
        """Writer thread: a write batch reclaimed segments; `dropped` (namespace, key) left the disk tier."""
        with self._lock:
            self._counters.disk_reinserted += reinserted
            if not dropped:
                return
            cat = self._cat
            by_ns: dict[str, list[bytes]] = {}
            for name, key in dropped:
                by_ns.setdefault(name, []).append(key)
            for name, keys in by_ns.items():
                ns = cat.by_name.get(name)
                if ns is not None:
                    gone: list[bytes] = []  # no RAM entry: its last copy went
                    for key in keys:
                        eid = ns.index.get(key)
                        if eid is None:
                            gone.append(key)
                        elif cat.flags[eid] & ON_DISK:
                            cat.flags[eid] = DISK_DROPPED
                    self._misses.left(ns.id, gone, DISK_RECLAIMED)
                self._events.publish(REMOVED, name, keys, Tier.DISK)

    def finish_promotion(self, p: Promotion, status: DiskStatus) -> None:
        """Promoter thread: the read into the slot ended; commit the entry or give the slot back."""
        with self._lock:
            cat = self._cat
            self._promotions.pop(p.eid, None)
            alive = cat.state[p.eid] == _PROMOTING and cat.keys[p.eid] == p.key
            if status is DiskStatus.OK and alive and not p.cancelled:
                self._ram.apply_touches()
                cat.state[p.eid] = _COMMITTED
                cat.created[p.eid] = cat.now()
                ns = cat.namespace_of(p.eid)
                ns.blocks += 1
                ns.bytes += int(cat.size[p.eid])
                self._ram.insert(ns, [p.eid])
                if cat.mirror is not None:
                    cat.mirror.added([p.eid])
                if cat.journal is not None:
                    cat.journal.committed([p.eid])
                self._events.publish(MOVED, ns.name, [p.key], Tier.DISK, Tier.RAM)
                p.ok = True
                if self.on_promoted is not None:
                    self.on_promoted(p.eid, True)
            else:
                if alive:
                    if self.on_promoted is not None:
                        self.on_promoted(p.eid, False)
                    cat.unindex(p.eid)
                    self._ram.free(p.eid)
                self._counters.promotion_failures += 1
                if status is DiskStatus.CHECKSUM_ERROR:
                    self._counters.checksum_failures += 1
        p.done.set()
