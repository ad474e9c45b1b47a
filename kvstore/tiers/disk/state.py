"""The parts an open DiskStore shares between its write path, read path and facade, and the locks over them.

Locks, always taken in this order (a thread holding a later one never waits for an earlier one)::

    writer  one write_many / probe / open / close at a time (the engine has one writer thread anyway).
            Held across the batch's data I/O: it orders batches, it does not block readers or lookups.
    mutate  serializes index write transactions together with the SegmentTable membership they change, so
            a reclamation sees every committed entry of its segment. Held across an lmdb commit (an fsync
            with sync="data"), never across data pread/pwrite.
    lock    in-memory state: SegmentTable, counters, health, the in-flight read count, the sequence counter.
            Held for short, I/O-free work (index lookups are lmdb reads of mapped memory) and NEVER across a
            data pwrite/pread, a fdatasync, a preallocation or an index commit.

close() and the read-only -> writable switch of probe() first pause reads (pause_reads: no new ones, wait for
those in flight) and only then take `mutate` and `lock` to swap the index and descriptors: an in-flight read
may need `mutate` to drop a bad entry, so waiting for it while holding `mutate` would deadlock.

A reader holds no lock during its pread: it notes the record's (segment, seq) under `lock`, reads, and checks
under `lock` again that the segment was not reused meanwhile (SegmentTable.is_current). A race is a miss.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.tiers.disk.config import DiskConfig, round_up
from kvstore.tiers.disk.counters import DiskCounters
from kvstore.tiers.disk.floors import TenantFloors
from kvstore.tiers.disk.health import Health
from kvstore.tiers.disk.index import DiskIndex, IndexEntry
from kvstore.tiers.disk.io import BlockIO
from kvstore.tiers.disk.segments import SegmentFiles, SegmentTable

__all__ = ["StoreState"]

log = logging.getLogger("kvstore.tiers.disk")


class StoreState:
    def __init__(
        self,
        config: DiskConfig,
        io: BlockIO,
        files: SegmentFiles,
        table: SegmentTable,
        index: DiskIndex,
        health: Health,
        counters: DiskCounters,
        writer: threading.Lock,
        mutate: threading.Lock,
        lock: threading.Lock,
    ) -> None:
        self.config = config
        self.io = io
        self.files = files
        self.table = table
        self.index = index
        self.health = health
        self.counters = counters
        self.writer = writer
        self.mutate = mutate
        self.lock = lock
        self.idle = threading.Condition(lock)   # notified when the last in-flight read ends, and on resume()
        self.inflight = 0
        self.paused = False      # close() or a probe swapping index/files: new reads wait
        self.closed = False
        self.next_seq = 1
        self.floors: TenantFloors | None = None   # per-tenant disk quotas (floors.py); set by DiskStore.set_floors
        # which (namespace, key) records have a RAM copy that counts on them (DiskStore.set_resident): no second
        # chance for those at reclamation
        self.resident: Callable[[list[tuple[str, bytes]]], list[bool]] | None = None

    def alloc_seq(self) -> int:
        """Caller holds `lock`."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def forget(self, removed: list[tuple[bytes, IndexEntry]]) -> None:
        """Membership bookkeeping after entries left the index. Caller holds `lock`."""
        for ikey, entry in removed:
            self.table.remove(entry.segment, ikey, entry.seq, round_up(entry.stored_length))

    def drop_entry(self, ikey: bytes, entry: IndexEntry) -> bool:
        """Delete an entry that proved unreadable, unless the key was rewritten since (another seq)."""
        try:
            with self.mutate:
                gone = self.index.delete_if(ikey, entry.seq)
                if gone is None:
                    return False
                with self.lock:
                    self.forget([(ikey, gone)])
                    self.counters.dropped_entries += 1
                return True
        except OSError as exc:
            log.debug("could not drop a bad disk index entry: %s", exc)
            return False

    def pause_reads(self) -> None:
        """Stop new reads and wait for the in-flight ones (which may still take `mutate` to drop an entry, so
        the caller must NOT hold `mutate`). Caller holds `lock` (released while waiting)."""
        self.paused = True
        while self.inflight:
            self.idle.wait()

    def resume_reads(self) -> None:
        """Caller holds `lock`."""
        self.paused = False
        self.idle.notify_all()

    def begin_read(self) -> bool:
        """Count a read in flight; False when the store closed. Caller holds `lock`."""
        while self.paused:
            self.idle.wait()
        if self.closed:
            return False
        self.inflight += 1
        return True

    def end_read(self) -> None:
        """Caller holds `lock`."""
        self.inflight -= 1
        if self.inflight == 0:
            self.idle.notify_all()
