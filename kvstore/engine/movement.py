"""Background threads that move bytes between the arena and the disk tier.

Metadata decisions stay in the engine; these threads only run the I/O outside the engine's lock and report
through a small hooks object (`MoverHooks`, implemented by kvstore.engine.disk_link.DiskLink, which takes the
engine's lock for each call):

- the writer drains a bounded queue of committed blocks (write-behind: a block admitted to the disk tier is
  copied soon after its commit, so a later RAM eviction is a metadata-only drop and never waits for I/O).
  It claims a batch through the hooks (which put an I/O hold on each slot), writes it with one
  `DiskStore.write_batch` call straight from the arena slots, and reports back the blocks that the batch's
  segment reclamations dropped (first: they left the disk before the batch landed) and the statuses.
- promoter threads read blocks that a Lookup found only on disk into slots the engine allocated, then report
  back; the Lookup (or a get waiting on it) is woken through the promotion's event. Each promoter reads the
  queue as a stream (DiskStore.read_stream): a block is verified, and reported, while its next read is in
  flight; the last one at once.

A full write queue rejects new blocks (counted): under overload, the disk tier keeps fewer copies rather than
slowing puts.

Reads go first: the writer does not start a batch while promotions are queued or being read (for at most
`yield_s`). A get waits for its promotions and nobody waits for write-behind; and a write batch may reclaim a
disk segment, which would make a promotion queued before it a miss or not depending on which thread ran first
(the replay's simulator relies on a Lookup's promotions being read before the writes its hits queued).
Write-backs a promotion waits for (disk_write=evict) are not held back: that promotion is not queued until
its room is made (disk_link.py).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.tiers.disk import DiskStatus, DiskStore, WriteItem, WriteResult

__all__ = ["Mover", "Promotion", "MoverHooks"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Promotion:
    """One block being read from disk into the arena slot of entry `eid`."""

    eid: int
    namespace: str
    key: bytes
    address: int    # 0 while it waits for room (disk_link.py)
    capacity: int
    length: int = 0  # the block's stored length (what its slot must hold)
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    cancelled: bool = False


class MoverHooks(Protocol):
    """What the mover's threads call back, with no lock held (each call takes the engine's lock itself)."""

    def claim_writes(self, batch: list[tuple[int, int, bytes]]) -> tuple[list[WriteItem], list[int]]: ...
    def finish_writes(self, eids: list[int], statuses: list[DiskStatus]) -> list[tuple[str, bytes]]: ...
    def finish_reclaim(self, dropped: list[tuple[str, bytes]], reinserted: int) -> None: ...
    def finish_promotion(self, p: Promotion, status: DiskStatus) -> None: ...


class Mover:
    def __init__(self, disk: DiskStore, hooks: MoverHooks, *, queue_blocks: int = 4096, batch_blocks: int = 16,
                 promoters: int = 2, yield_s: float = 1.0) -> None:
        self._disk = disk
        self._hooks = hooks
        self._max_queue = queue_blocks
        self._batch = batch_blocks
        self._writes: deque[tuple[int, int, bytes]] = deque()
        self._promotions: deque[Promotion] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._in_flight = 0  # blocks claimed by the writer and not yet reported back
        self._reading = 0  # promotions taken by a promoter and not yet reported back
        self._yield_s = yield_s
        self._threads = [threading.Thread(target=self._write_loop, name="kvstore-disk-writer", daemon=True)]
        self._threads += [threading.Thread(target=self._promote_loop, name=f"kvstore-promoter-{i}", daemon=True)
                          for i in range(promoters)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 10.0, leave_writes: bool = False) -> list[tuple[int, int, bytes]]:
        """Finish queued promotions and writes (so a clean shutdown leaves the disk tier complete), then stop.
        `leave_writes` (a hand-over): only the batch being written finishes; the queued writes are returned."""
        left: list[tuple[int, int, bytes]] = []
        with self._cond:
            if leave_writes:
                left = list(self._writes)
                self._writes.clear()
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout_s)
        return left

    @property
    def queued_writes(self) -> int:
        """Blocks waiting for the writer or being written (0 means every admitted block has landed)."""
        return len(self._writes) + self._in_flight

    def enqueue_writes(self, items: list[tuple[int, int, bytes]]) -> int:
        """Queue (eid, namespace id, key) for write-behind; returns how many fit. Never blocks."""
        with self._cond:
            room = max(0, self._max_queue - len(self._writes))
            accepted = items[:room]
            self._writes.extend(accepted)
            if accepted:
                self._cond.notify_all()
            return len(accepted)

    def enqueue_promotions(self, ps: list[Promotion]) -> None:
        """Queue reads, in order (a Lookup's, in its chain's order)."""
        with self._cond:
            self._promotions.extend(ps)
            self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._writes and not self._stopping:
                    self._cond.wait()
                if not self._writes:
                    return
                batch = [self._writes.popleft() for _ in range(min(self._batch, len(self._writes)))]
                self._in_flight = len(batch)
            try:
                self._write_batch(batch)
            finally:
                with self._cond:
                    self._in_flight = 0

    def _write_batch(self, batch: list[tuple[int, int, bytes]]) -> None:
        items, eids = self._hooks.claim_writes(batch)
        if not items:
            return
        with self._cond:  # reads go first (module docstring); checked after the claim, which took the engine's
            # lock: a Lookup that queued this batch's writes has queued its promotions by then too
            self._cond.wait_for(lambda: not (self._promotions or self._reading) or self._stopping, self._yield_s)
        try:
            result = self._disk.write_batch(items)
        except Exception:  # the writer must survive a bad batch; the holds must be given back either way
            log.exception("disk writer failed on a batch of %d blocks", len(items))
            result = WriteResult([DiskStatus.IO_ERROR] * len(items))
        if result.reclaimed or result.reinserted:
            self._hooks.finish_reclaim(result.reclaimed, result.reinserted)
        for ns, key in self._hooks.finish_writes(eids, result.statuses):
            self._disk.delete(ns, [key])  # deleted while its write was in flight

    def _promote_loop(self) -> None:
        while True:
            with self._cond:
                while not self._promotions and not self._stopping:
                    self._cond.wait()
                if not self._promotions:
                    return
            try:   # until the queue is empty; each block verified while this thread reads the next one
                self._disk.read_stream(self._next_promotion, self._promoted)
            except Exception:   # every promotion taken was reported (read_stream's contract)
                log.exception("promotions from disk failed")

    def _next_promotion(self) -> Promotion | None:
        """The next queued promotion for this promoter's stream (cancelled ones reported as misses), or None."""
        while True:
            with self._cond:
                if not self._promotions:
                    return None
                p = self._promotions.popleft()
                self._reading += 1
            if not p.cancelled:
                return p
            self._promoted(p, DiskStatus.NOT_FOUND, 0)

    def _promoted(self, p: Promotion, status: DiskStatus, _length: int) -> None:
        try:
            self._hooks.finish_promotion(p, status)
        finally:
            with self._cond:
                self._reading -= 1
                if not self._reading:
                    self._cond.notify_all()
