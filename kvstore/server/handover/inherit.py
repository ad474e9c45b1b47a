"""What a daemon starts from when it keeps a predecessor's RAM tier, and the checks before it serves any of it.

Two ways in, one way through:
- a hand-over (receiver.py): the running daemon sends its files, then its live state, and stops serving;
- systemd's file descriptor store (fdstore.py): the files of a daemon that stopped or crashed come back at start.

Either way `open_arena` maps the files as the journal describes them (kvstore/arena/backing.py adopt) or says
why it cannot (another journal format or arena geometry: the daemon starts cold and logs that line), and
`verified_entries` checks every journal record against the arena (kvstore/arena/verify.py) and hands the
engine only what passed (kvstore/engine/adoption.py checks the rest: namespaces, tenants, slot overlaps).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.arena.backing import SHARED_DOMAIN, ArenaBacking
from kvstore.arena.files import ArenaFile
from kvstore.arena.journal import JournalMismatch, RamJournal
from kvstore.arena.layout import ArenaLayout
from kvstore.arena.verify import Fingerprint, Verification, verify
from kvstore.engine.adoption import AdoptedEntries, LiveState
from kvstore.fastpath.key_index import IndexTable, capacity_for
from kvstore.origins import BlockOrigin

__all__ = ["Inherited", "open_arena", "verified_entries", "carried_index"]

log = logging.getLogger(__name__)


@dataclass
class Inherited:
    """A predecessor's RAM tier, handed to this daemon. `arena` is mapped and owned (None: nothing usable
    came, `why` says what); the rest comes only with a hand-over."""

    source: str                                      # "hand-over" or "fd store"
    arena: ArenaBacking | None = None
    why: str = ""
    known: dict[int, Fingerprint] = field(default_factory=dict)  # records verified before the hand-over's window
    index_fds: dict[str, int] = field(default_factory=dict)      # domain -> key index table
    index_capacity: int = 0
    incarnation: int = 0                             # 0: this daemon takes a new one (clients remap)
    live: LiveState | None = None
    sessions: list[tuple[str, str, list[bytes], float, bool]] = field(default_factory=list)
    kv_origins: list[tuple[str, bytes, BlockOrigin]] = field(default_factory=list)  # the KV events' identities
    peer_lease: int = 0
    fast_listener: socket.socket | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def close_unused(self) -> None:
        """Close the descriptors nothing took (a daemon that starts cold after all)."""
        for fd in self.index_fds.values():
            _close(fd)
        self.index_fds = {}
        if self.fast_listener is not None:
            self.fast_listener.close()
            self.fast_listener = None


def open_arena(layout: ArenaLayout, journal_fd: int, files: dict[str, int], *, isolated: bool,
               lock: str) -> tuple[ArenaBacking | None, str]:
    """The predecessor's arena mapped from its files (domain -> fd; all owned from now on, closed on refusal),
    or (None, why not). Why not: no journal, another format or geometry, a file not of this arena's size."""
    taken: dict[str, ArenaFile] = {}
    try:
        if journal_fd < 0:
            raise JournalMismatch("no RAM journal came with the arena files")
        if SHARED_DOMAIN not in files:
            raise JournalMismatch("the shared arena file did not come")
        journal = RamJournal.open(journal_fd, layout)
        journal_fd = -1
        try:
            for domain in list(files):
                taken[domain] = ArenaFile.adopt(files.pop(domain), f"{layout.name}-tenant-{domain}" if domain
                                                else layout.name, layout.size_bytes)
            if not isolated and set(taken) != {SHARED_DOMAIN}:
                raise JournalMismatch("the predecessor kept tenants' files (tokens_file set) and this daemon has "
                                      "no tokens: their blocks would be readable by everyone")
            arena, lost = ArenaBacking.adopt(layout, taken, journal, isolated=isolated, lock=lock)
        except BaseException:
            journal.close()
            raise
        if lost:
            log.warning("%d arena slabs belonged to tenants' files that did not come: their blocks are dropped",
                        len(lost))
        return arena, ""
    except (JournalMismatch, ValueError, OSError) as exc:
        for f in taken.values():
            f.close()
        for fd in files.values():
            _close(fd)
        if journal_fd >= 0:
            _close(journal_fd)
        return None, str(exc)


def verified_entries(arena: ArenaBacking, known: dict[int, Fingerprint] | None = None, owner: bool = True
                     ) -> tuple[AdoptedEntries, Verification, dict[int, dict[str, object]], int]:
    """The journal's records that pass every check against the arena, the verification's counts, the
    namespaces by id and how many namespace records failed their check. `owner`: this daemon owns the journal
    now, and clears the records that failed (not while the predecessor still writes it: a hand-over's first
    pass)."""
    journal = arena.journal
    scan = journal.scan()
    v = verify(scan, arena.layout, arena.view, arena.generations, known=known)
    rec = scan.records[v.ok]
    all_keys = scan.keys()
    keys = [k for k, ok in zip(all_keys, v.ok.tolist()) if ok]
    rejected = [(int(ns), k) for ns, k, ok in zip(scan.records["ns"].tolist(), all_keys, v.ok.tolist()) if not ok]
    entries = AdoptedEntries(scan.eids[v.ok].astype(np.int64), rec["ns"].astype(np.int64), keys,
                             rec["offset"].astype(np.int64), rec["size"].astype(np.int64),
                             rec["checksum"].astype(np.uint64), rec["serial"].astype(np.int64), rejected)
    if owner:
        journal.clear_entries(scan.eids[~v.ok])
        if scan.bad_eids is not None:
            journal.clear_entries(scan.bad_eids)
    namespaces, bad = journal.namespaces(journal.namespace_ids_written())
    return entries, v, namespaces, bad


def carried_index(inh: Inherited | None, key_index_entries: int,
                  damaged_headers: int = 0) -> tuple[dict[str, IndexTable] | None, int]:
    """The predecessor's key index tables and incarnation, when this daemon can carry both on (a hand-over
    with the same key_index_entries): clients then keep their arena mappings, offsets, leases and tables.
    Else (None, 0): a new incarnation, fresh tables (clients remap, as after any restart)."""
    if inh is None or not inh.incarnation:
        return None, 0
    fds, inh.index_fds = inh.index_fds, {}
    if damaged_headers:  # a record too damaged to name its key: its key may still be in the tables
        for fd in fds.values():
            os.close(fd)
        log.warning("take-over: %d journal records were damaged: the key index starts afresh and clients remap "
                    "once", damaged_headers)
        return None, 0
    same = (key_index_entries and fds and inh.index_capacity == capacity_for(key_index_entries))
    if not same:
        for fd in fds.values():
            os.close(fd)
        if fds or key_index_entries or inh.extra.get("index_entries"):
            log.info("take-over: the shared key index differs (key_index_entries): clients remap once")
            return None, 0
        return None, inh.incarnation  # neither side has a key index: nothing of it to keep
    tables: dict[str, IndexTable] = {}
    try:
        for domain in list(fds):
            tables[domain] = IndexTable.adopt(fds.pop(domain), inh.index_capacity, inh.incarnation)
    except ValueError as exc:
        for t in tables.values():
            t.close()
        for fd in fds.values():
            os.close(fd)
        log.warning("take-over: the key index handed over is unusable (%s): clients remap once", exc)
        return None, 0
    return tables, inh.incarnation


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
