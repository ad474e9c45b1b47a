"""EngineRestarts: what the engine does for a restart that keeps the RAM tier (a base class of Engine, engine.py,
which owns the parts): keep the RAM journal (journal_link.py) in step, stop without finishing the write-behind
queue, export the live state, adopt a predecessor's entries (adoption.py). The daemon's hand-over
(kvstore/server/handover/) and systemd's fd store drive these; nothing here does I/O but the disk index reads
of an adoption.
"""

from __future__ import annotations

import time

import numpy as np

from kvstore.arena.journal import RamJournal
from kvstore.engine.adoption import AdoptedEntries, AdoptReport, LiveState, Parts, adopt, export_live
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.catalog import Catalog, EntryState
from kvstore.engine.counters import Counters
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.engine_lock import EngineLock
from kvstore.engine.generations import GenerationIndex
from kvstore.engine.hints import Hints
from kvstore.engine.journal_link import JournalLink
from kvstore.engine.leases import LeaseTable
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.reservations import ReservationTable
from kvstore.engine.spares import SpareSlots

__all__ = ["EngineRestarts"]

_COMMITTED = int(EntryState.COMMITTED)


class EngineRestarts:
    """The restart operations; the parts are Engine's (set in its __init__)."""

    layout: ArenaLayout
    _lock: EngineLock
    _cat: Catalog
    _ram: RamSpace
    _leases: LeaseTable
    _reservations: ReservationTable
    _spares: SpareSlots
    _hints: Hints
    _disk: DiskLink
    journal: JournalLink | None
    counters: Counters

    def attach_journal(self, journal: RamJournal, generations: np.ndarray) -> JournalLink:
        """Keep `journal` saying which RAM entries are committed (before any block is stored, or right after an
        adoption); every namespace known so far is written to it."""
        with self._lock:
            link = JournalLink(self._cat, journal, generations, GenerationIndex(journal.layout), self._lock)
            self._cat.journal = link
            self.journal = link
            for ns in self._cat.namespaces:
                link.namespace(ns)
            return link

    def sync_journal(self, view: np.ndarray, hash_missing: bool, everything: bool = False) -> int:
        """Write the journal records pending (`everything`: of every committed entry), hashing blocks without
        an xxh3 when `hash_missing`; no lock held while hashing. The records written."""
        link = self.journal
        if link is None:
            return 0
        if everything:  # a hand-over's prepare: from now on every pass hashes (its window then hashes little)
            with self._lock:
                link.mark_all()
                link.hash_always = True
        return link.sync(view, hash_missing)

    def end_handover_hashing(self) -> None:
        """The hand-over failed: the journal thread hashes only as configured again."""
        if self.journal is not None:
            self.journal.hash_always = False

    def freeze(self) -> None:
        """From now on only this thread may use the engine (engine_lock.py): a hand-over's window."""
        self._lock.freeze()

    def thaw(self) -> None:
        self._lock.thaw()

    def freeze_journal(self, view: np.ndarray) -> int:
        """Under the lock (the engine frozen): every pending record, blocks without an xxh3 hashed."""
        link = self.journal
        if link is None:
            return 0
        with self._lock:
            link.mark_unhashed()  # records the journal thread wrote since the prepare, unhashed
            return link.write_locked(view)

    def stop_for_handover(self) -> int:
        """Stop the disk I/O threads for a hand-over: the batch being written and the promotions in flight
        finish, queued writes are left to the successor (it queues every adopted block the disk tier lacks).
        Returns the writes left. `restart_io` undoes it when the hand-over fails."""
        return self._disk.stop_for_handover()

    def restart_io(self) -> None:
        """The hand-over failed: the disk I/O threads run again, with the writes that were left queued."""
        self._disk.restart()

    def export_live(self) -> LiveState:
        """The live state (leases, reservations, pins, order...) of an idle engine, for a successor."""
        with self._lock:
            self._ram.apply_touches()
            return export_live(self._parts(), time.monotonic())

    def adopt(self, entries: AdoptedEntries, live: LiveState | None, lost_namespaces: set[int],
              slab_domain: list[str], tables_kept: bool) -> tuple[AdoptReport, list[tuple[int, bytes]]]:
        """Place a predecessor's verified entries and live state (adoption.py) in this fresh engine, before it
        serves; `slab_domain[s]`: the domain whose file backs slab s. The journal's records of the entries not
        adopted are cleared."""
        with self._lock:
            report, gone = adopt(self._parts(), entries, live, lost_namespaces, slab_domain.__getitem__,
                                 self.layout.slab_of, time.monotonic(), tables_kept)
            if self.journal is not None:
                cat, n = self._cat, len(self._cat.keys)
                self.journal.removed([e for e in entries.eids.tolist() if e >= n or cat.state[e] != _COMMITTED])
            return report, gone

    def count_restart(self, adopted: int, dropped: dict[str, int]) -> None:
        """A restart that kept the RAM tier: what it adopted and dropped, by reason (Stats, the metrics)."""
        with self._lock:
            c = self.counters
            c.restart_adopted_blocks += adopted
            for reason, n in dropped.items():
                name = f"restart_dropped_{reason}"
                setattr(c, name, getattr(c, name) + n)

    def _parts(self) -> Parts:
        return Parts(self._cat, self._ram, self._leases, self._reservations, self._spares, self._hints, self._disk,
                     self._cat.mirror)  # type: ignore[arg-type]  # the mirror is a KeyIndexMirror or None
