"""The engine's link to the disk tier: when blocks are written (disk_write), admission and the write budget,
promotions (promotions.py), and the mover's hooks.

disk_write = commit (write-behind): a block is queued for the disk writer when admission (and the budget) accept
it: at commit, or when a later hit raises its use count. Its slot is held (leases + 1) only while the write
runs. A commit's blocks are queued in the commit's order (the chain's): the disk tier appends them in that
order, so a prefix chain lands in one segment (or consecutive ones) and ages out together. Evicting a block
with a disk copy then drops only the RAM copy; evicting one without drops it.

disk_write = evict: nothing is written at commit. When RAM evicts a block with no disk copy that admission
(the block's use count) and the budget accept, `write_back` takes it: flagged EVICTING and QUEUED, held, out
of the policy, still readable; the writer writes it and `finish_writes` frees its slot (ram_space.py). A block
promoted from disk keeps its disk copy, so evicting it again writes nothing; a disk copy that segment
reclamation dropped (DISK_DROPPED) is written again at the next eviction (admission is not asked again). So the disk holds what RAM let go
of, and RAM and disk hold mostly different blocks. Segment reclamation asks `resident` which of its records'
blocks are in RAM with that copy (promoted): those get no second chance (RAM holds them, and writes them back
when it evicts them), the other records read since their write do. A Reserve whose slots wait for write-backs
waits for them outside the engine's lock (`wait_room`, Engine.reserve).

Budget (`budget`, kvstore/policies/write_budget.py): a block admission accepts is offered to it; refused, it is
not written (under evict its eviction drops it). A Demote hint bypasses admission and the budget, and is
charged to it. Release (`let_go`): a block let go of is written nowhere, and its disk copy is deleted.

Reclamation: the disk writer reports the blocks whose record a segment reclamation dropped. A RAM copy of such a
block loses its ON_DISK mark (DISK_DROPPED), and each is published as removed from the disk tier.

Locking: methods are called under the engine's lock, except the MoverHooks (claim_writes, finish_writes,
finish_reclaim, finish_promotion) and `resident`, which the mover's threads call with no lock held: they take
the engine's lock themselves; and `probe_if_due`, `start`, `stop`, `delete`, `delete_let_go`, `with_room`,
which run outside it (they do I/O, join threads or wait; `with_room` takes the lock for its call). `resident` runs in the writer thread while the disk
store's writer lock is held; no holder of the engine's lock ever waits for that lock (it takes only the
store's state lock, for index reads), so the order writer -> engine -> store state cannot deadlock. The room
condition (`_room`) is taken after the engine's lock only to notify, and alone by `with_room` to wait.
With no disk tier every method is a cheap no-op (or says "nothing on disk").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from kvstore.engine.catalog import (DISK_DROPPED, EVICTING, GUEST, LET_GO, ON_DISK, QUEUED, WRITING, Catalog,
                                    EntryState, Namespace)
from kvstore.engine.counters import Counters
from kvstore.engine.engine_lock import EngineLock
from kvstore.engine.events import REMOVED, STORED, EventBus
from kvstore.engine.leases import LeaseTable
from kvstore.engine.misses import DELETED, DISK_RECLAIMED, MissLedger
from kvstore.engine.movement import Mover, Promotion
from kvstore.engine.promotions import Promotions
from kvstore.engine.ram_space import RamSpace, RoomPending
from kvstore.errors import StoreFullError
from kvstore.policies.admission import AdmissionPolicy, AlwaysAdmit, check_write_mode
from kvstore.policies.write_budget import WriteBudget
from kvstore.tiers.disk import DiskStatus, DiskStore, WriteItem
from kvstore.vocab import Tier

__all__ = ["DiskLink"]

T = TypeVar("T")

_COMMITTED = int(EntryState.COMMITTED)
_DOOMED = int(EntryState.DOOMED)


class DiskLink:
    """What the engine does with the disk tier, and the hooks its mover calls back (kvstore.engine.movement).

    Called under the engine's lock, but for the hooks and the calls that run without it (module docstring)."""

    def __init__(self, store: DiskStore | None, admission: AdmissionPolicy | None, *, cat: Catalog,
                 ram: RamSpace, leases: LeaseTable, counters: Counters, events: EventBus, lock: EngineLock,
                 arena_address: int = 0, queue_blocks: int = 4096, misses: MissLedger | None = None,
                 write_mode: str = "commit", budget: WriteBudget | None = None) -> None:
        self.store = store
        self.admission = admission or AlwaysAdmit()
        self.write_mode = check_write_mode(write_mode)
        self.budget = budget
        self._cat = cat
        self._ram = ram
        self._leases = leases
        self._counters = counters
        self._events = events
        self._lock = lock  # the engine's: taken by the hooks only
        self._misses = misses if misses is not None else MissLedger(0)  # reclaimed keys with no RAM copy go in
        self._arena_address = arena_address
        self.mover = Mover(store, self, queue_blocks=queue_blocks) if store is not None else None
        self._queue_blocks = queue_blocks
        self._left: list[tuple[int, int, bytes]] = []  # writes a hand-over left queued (restart re-queues them)
        self.promotions = Promotions(cat, ram, counters, events, self.mover, arena_address)
        self._next_probe = 0.0
        self._let_go: list[tuple[str, bytes]] = []  # disk copies a Release let go of: deleted after the lock
        self._room = threading.Condition()  # notified when write-backs land (a Reserve may wait for them)
        self.writebacks = 0  # write-backs queued or being written
        self.on_written: Callable[[list[int]], None] | None = None  # hints.py: after each batch, under the lock
        if store is not None and write_mode == "evict":
            ram.write_back = self.write_back
            store.set_resident(self.resident)

    @property
    def on_promoted(self) -> Callable[[int, bool], None] | None:
        return self.promotions.on_promoted

    @on_promoted.setter
    def on_promoted(self, fn: Callable[[int, bool], None] | None) -> None:  # hints.py: (entry, landed)
        self.promotions.on_promoted = fn

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
        self.promotions.use_mover(self.mover)
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

    def delete_let_go(self, gone: list[tuple[str, bytes]]) -> None:
        """Delete the disk copies Release hints let go of (`take_let_go`, under the lock, gave them)."""
        by_ns: dict[str, list[bytes]] = {}
        for name, key in gone:
            by_ns.setdefault(name, []).append(key)
        for name, keys in by_ns.items():
            self.delete(name, keys)

    def with_room(self, fn: Callable[[], T], timeout_s: float) -> T:
        """`fn` (a Reserve) under the engine's lock; while it finds its victims being written back (RoomPending,
        ram_space.py) wait with no lock held until no write-back is in flight and run it again (it plans anew).
        StoreFullError (counted) when the writes have not landed after `timeout_s`."""
        deadline = 0.0
        while True:
            with self._lock:
                try:
                    return fn()
                except RoomPending:
                    self._counters.room_waits += 1
            deadline = deadline or time.monotonic() + timeout_s
            with self._room:
                if self._room.wait_for(lambda: self.writebacks == 0, max(0.0, deadline - time.monotonic())):
                    continue
            with self._lock:
                self._counters.store_full += 1
            raise StoreFullError(
                f"store full: the blocks RAM evicted to make room are still being written to the disk tier after "
                f"{timeout_s:g} s (promote_timeout_s); the disk is slower than the puts: lower high_watermark "
                "(more room written ahead), use a faster disk_dir, or retry")

    @property
    def queued_writes(self) -> int:
        return self.mover.queued_writes if self.mover is not None else 0

    # -- under the engine's lock: admission and writing ----------------------------------------------
    def contains_many(self, ns_name: str, keys: Sequence[bytes]) -> list[int]:
        """Stored length of each key on disk (0: absent); all 0 without a disk tier."""
        return self.store.contains_many(ns_name, keys) if self.store is not None else [0] * len(keys)

    def on_commit(self, eids: list[int]) -> None:
        """A commit's blocks have been used once: under commit, queue them if admission takes a first use."""
        if self.store is not None:
            ids = np.array(eids, dtype=np.int64)
            self._cat.seen[ids] = 1
            if self.write_mode == "commit" and self.admission.admits(1):
                self.queue_writes(ids)

    def note_hits(self, ids: np.ndarray) -> None:
        """Raise the use counts of RAM hits; under commit, queue the ones that just became admissible."""
        if self.store is None or not len(ids):
            return
        cat = self._cat
        seen = cat.seen[ids]
        cat.seen[ids] = np.minimum(seen.astype(np.int16) + 1, 255)
        if self.write_mode == "commit":
            self.queue_writes(ids[(cat.seen[ids] >= self.admission.threshold) & (cat.flags[ids] == 0)])

    def queue_writes(self, ids: np.ndarray, bypass: bool = False) -> None:
        """Queue blocks for write-behind (commit; a Demote with `bypass`: no budget check, only its charge)."""
        if self.mover is None or not len(ids):
            return
        cat = self._cat
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # each once, in the caller's (chain) order
        if self.budget is not None:
            ids = ids[self._budget_filter(cat.size[ids].tolist(), bypass)]
        items = [(int(e), int(cat.ns[e]), cat.keys[e]) for e in ids.tolist()]
        accepted = self.mover.enqueue_writes(items)
        cat.flags[ids[:accepted]] |= QUEUED
        self._counters.disk_writes_queued += accepted
        self._counters.demote_queue_full += len(items) - accepted

    def _budget_filter(self, sizes: list[int], bypass: bool) -> list[bool]:
        assert self.budget is not None
        if bypass:
            for size in sizes:
                self.budget.charge(size)
            return [True] * len(sizes)
        return [self.budget.admit(size) for size in sizes]

    def write_back(self, eids: list[int], force: bool = False) -> list[bool]:
        """Victims of an eviction (the policy has forgotten them), under disk_write=evict: True for each taken to be
        written before its slot is freed. Not taken: a block with a disk copy (only its RAM copy goes), or one
        that a Release let go of, admission or the budget refuses, or that finds the tier degraded or the write
        queue full (it is dropped: counted in evicted_unwritten or demote_queue_full), and a peer tier's guest
        (a copy another node owns: GUEST). `force` (a Demote):
        admission and the budget are not asked (the budget is charged). A block whose disk copy reclamation
        dropped while RAM held it (DISK_DROPPED: admitted once already, its use count restarted at its promotion)
        is not asked admission either, only the budget: otherwise cleaning (reclaim.py) would turn every
        promoted block under seen:N into one the disk never takes back."""
        cat, counters = self._cat, self._counters
        out = [False] * len(eids)
        todo: list[int] = []
        usable = self.mover is not None and self.store is not None and not self.store.degraded
        for i, eid in enumerate(eids):
            flags = int(cat.flags[eid])
            if flags & ON_DISK:
                continue
            if not usable or flags & (LET_GO | GUEST):  # let go of, or a copy this node does not own
                counters.evicted_unwritten += 1
            elif force or flags & DISK_DROPPED or self.admission.admits(int(cat.seen[eid])):
                todo.append(i)
            else:
                counters.evicted_unwritten += 1
        if self.budget is not None and todo:
            keep = self._budget_filter([int(cat.size[eids[i]]) for i in todo], force)
            counters.evicted_unwritten += keep.count(False)
            todo = [i for i, k in zip(todo, keep) if k]
        if not todo:
            return out
        assert self.mover is not None
        items = [(eids[i], int(cat.ns[eids[i]]), cat.keys[eids[i]]) for i in todo]
        accepted = self.mover.enqueue_writes(items)  # type: ignore[arg-type]  # a live entry's key is set
        for i in todo[:accepted]:
            eid = eids[i]
            cat.flags[eid] = (int(cat.flags[eid]) & ~DISK_DROPPED) | EVICTING | QUEUED
            cat.leases[eid] += 1  # held: never chosen again, never reused before the write lands
            out[i] = True
        self.writebacks += accepted
        counters.disk_writes_queued += accepted
        counters.disk_writebacks += accepted
        counters.demote_queue_full += len(todo) - accepted
        return out

    def let_go(self, ns: Namespace, key: bytes, eid: int) -> None:
        """A Release: the block is written nowhere from now on (a RAM entry `eid`, or -1: only on disk), and its
        disk copy is deleted (after the lock: `delete_let_go`)."""
        if self.store is None:
            return
        cat = self._cat
        if eid >= 0:
            flags = int(cat.flags[eid])
            cat.flags[eid] = (flags & ~(ON_DISK | DISK_DROPPED)) | LET_GO
            if not flags & ON_DISK:
                return  # nothing on disk yet; a write in flight deletes its record when it lands
        else:
            self._misses.left(ns.id, [key], DELETED)
        self._let_go.append((ns.name, key))

    def flush(self) -> int:
        """Before a clean stop under evict: queue the admitted RAM blocks that have no disk copy (write-behind, in
        entry order, the budget and the queue's bound permitting), so a restart finds them; the mover's stop
        writes them. Returns how many were queued (0 under commit: written already)."""
        if self.write_mode != "evict" or self.mover is None:
            return 0
        cat = self._cat
        ids = cat.live_ids()
        busy = ON_DISK | QUEUED | WRITING | EVICTING | LET_GO | GUEST
        ids = ids[(cat.state[ids] == _COMMITTED) & ((cat.flags[ids] & busy) == 0)
                  & (cat.seen[ids] >= self.admission.threshold)]
        before = self._counters.disk_writes_queued
        self.queue_writes(ids)
        return self._counters.disk_writes_queued - before

    def take_let_go(self) -> list[tuple[str, bytes]]:
        """The (namespace, key) whose disk copies `let_go` marked for deletion since the last call."""
        gone, self._let_go = self._let_go, []
        return gone

    def keep_again(self, eid: int) -> None:
        """A Retain or Pin after a Release: the block may be written again."""
        self._cat.flags[eid] = int(self._cat.flags[eid]) & ~LET_GO

    # -- promotions (promotions.py) ---------------------------------------------------------------------
    def promotion(self, eid: int) -> Promotion | None:
        """The promotion in flight into entry `eid` (a PROMOTING entry), to join."""
        return self.promotions.get(eid)

    def begin_promotions(self, keep: set[int]) -> None:
        self.promotions.begin(keep)

    def start_promotion(self, ns: Namespace, key: bytes, length: int) -> Promotion | None:
        """A slot (or the promise of one) and a read of `key` into it, between begin and end_promotions."""
        return self.promotions.start(ns, key, length)

    def end_promotions(self) -> None:
        self.promotions.end()

    def cancel_promotion(self, eid: int) -> None:
        self.promotions.cancel(eid)

    # -- MoverHooks and the reclaim hook: called from the mover's threads, no lock held ---------------
    def claim_writes(self, batch: list[tuple[int, int, bytes]]) -> tuple[list[WriteItem], list[int]]:
        """Writer thread: turn queued entries that still exist into write items and hold their slots."""
        items: list[WriteItem] = []
        eids: list[int] = []
        with self._lock:
            cat = self._cat
            for eid, ns_id, key in batch:
                evicting = int(cat.flags[eid]) & EVICTING if eid < len(cat.keys) else 0
                live = (eid < len(cat.keys) and cat.state[eid] == _COMMITTED and int(cat.ns[eid]) == ns_id
                        and cat.keys[eid] == key and cat.flags[eid] & QUEUED and not cat.flags[eid] & LET_GO)
                if not live:
                    self._counters.demote_dropped += 1  # evicted, deleted or let go before the writer got to it
                    if evicting:  # a write-back's entry deleted meanwhile: give back its hold (frees a DOOMED one)
                        self._landed([eid], [eid])
                    continue
                cat.flags[eid] = WRITING | evicting  # not 0: a hit meanwhile must not queue it again
                if not evicting:
                    cat.leases[eid] += 1  # a write-back's entry has been held since write_back
                ns = cat.namespaces[ns_id]
                items.append(WriteItem(ns.name, key, self._arena_address + int(cat.offset[eid]), int(cat.size[eid]),
                                       ns.disk_codec))
                eids.append(eid)
        return items, eids

    def finish_writes(self, eids: list[int], statuses: list[DiskStatus]) -> list[tuple[str, bytes]]:
        """Writer thread: record results, free the slots of write-backs; returns (namespace, key) of blocks whose
        record must go again (deleted or let go of during their write)."""
        stale: list[tuple[str, bytes]] = []
        with self._lock:
            cat = self._cat
            landed: list[int] = []
            for eid, status in zip(eids, statuses):
                flags = int(cat.flags[eid])
                cat.flags[eid] = flags & (LET_GO | GUEST)  # a failed write may be retried by a later hit
                if status is DiskStatus.OK:
                    if not flags & LET_GO:
                        cat.flags[eid] |= ON_DISK
                    self._counters.disk_writes += 1
                    self._events.publish(STORED, cat.namespace_of(eid).name, [cat.keys[eid]], Tier.DISK)  # type: ignore[list-item]  # a live entry's key is set (None only once dropped)
                else:
                    self._counters.disk_write_failures += 1
                if cat.state[eid] == _DOOMED or (status is DiskStatus.OK and flags & LET_GO):
                    stale.append((cat.namespace_of(eid).name, cat.keys[eid]))  # type: ignore[arg-type]  # a live entry's key is set (None only once dropped)
                if flags & EVICTING:
                    landed.append(eid)
            if eids:
                self._landed(eids, landed)
                if self.on_written is not None:
                    self.on_written(eids)
        return stale

    def _landed(self, held: list[int], written_back: list[int]) -> None:
        """Give back the writer's holds; write-backs among them free their slots, and room waiters hear of it."""
        self._leases.unhold(np.array(held, dtype=np.int64))
        if not written_back:
            return
        for eid in written_back:
            self._ram.writeback_landed(eid)
        self.writebacks -= len(written_back)
        self.promotions.serve()
        with self._room:
            self._room.notify_all()

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
                            cat.flags[eid] = DISK_DROPPED | (int(cat.flags[eid]) & GUEST)
                    self._misses.left(ns.id, gone, DISK_RECLAIMED)
                self._events.publish(REMOVED, name, keys, Tier.DISK)

    def finish_promotion(self, p: Promotion, status: DiskStatus) -> None:
        """Promoter thread: the read into the slot ended; commit the entry or give the slot back."""
        with self._lock:
            self.promotions.finish(p, status)
        p.done.set()

    def resident(self, records: list[tuple[str, bytes]]) -> list[bool]:
        """Reclaim hook (disk_write=evict; the writer thread, which holds the store's writer lock): whether each
        (namespace, key) has a RAM copy that counts on its disk copy (committed, ON_DISK: a promoted block).
        Such records get no second chance: RAM holds the block and writes it again when it evicts it."""
        with self._lock:
            cat = self._cat
            out = []
            for name, key in records:
                ns = cat.by_name.get(name)
                eid = ns.index.get(key) if ns is not None else None
                out.append(eid is not None and cat.state[eid] == _COMMITTED and bool(cat.flags[eid] & ON_DISK))
            return out
