"""The catalog: which blocks exist, where they are, and in what state.

Memory is the design constraint: a daemon may hold millions of small blocks and must stay under ~256 bytes of
RSS per block. So an entry is not a Python object: entries are rows in numpy columns indexed by a dense entry
id (reused after removal), and each namespace keeps a plain dict key -> entry id. Per block that is a dict
slot, the key's bytes object, an int, one list slot for the reverse map and ~41 bytes of columns.

States of an entry (the engine moves them; the catalog only stores them)::

    RESERVED --commit--> COMMITTED --delete while leased--> DOOMED --last release--> (freed)
        |                    |--evict / delete--> (freed; a copy may live on in the disk tier)
        |--abort--> (freed)
        `--reservation TTL--> QUARANTINED --grace--> (freed)
    PROMOTING --read from disk ok--> COMMITTED;  --read failed / cancelled--> (freed)
    COMMITTED --evicted, disk_write=evict--> EVICTING flag, still COMMITTED --written--> (freed; on disk)

A PROMOTING entry may wait for room (offset -1) while the victims that make it are written (disk_link.py).

RESERVED, PROMOTING and COMMITTED entries are in a namespace's index; DOOMED and QUARANTINED ones are
invisible and wait for readers or late writers to be gone before their slot is reused.

`flags` records the disk tier's view of a RAM entry (ON_DISK: a verified copy exists, so eviction only drops
the RAM copy; QUEUED: waiting for the background writer; WRITING: its write is in flight; DISK_DROPPED: its copy
was dropped by segment reclamation, so under disk_write=commit eviction drops the block and hits do not queue
it again (the disk tier's reinsertion already chose what to keep), and under disk_write=evict its eviction
writes it again; EVICTING: chosen by eviction and being written first (disk_write=evict, or a Demote): still
readable, no longer in the policy, its slot freed when the write lands; LET_GO: a Release hint let go of it,
so it is written nowhere and its disk copy was deleted; GUEST: a copy the peer tier says this node does not
own, so an eviction never writes it here (a disk copy it has stays). `seen` is a saturating use count for
admission.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np

__all__ = ["Catalog", "CatalogJournal", "CatalogMirror", "EntryState", "Namespace", "ON_DISK", "QUEUED", "WRITING",
           "DISK_DROPPED", "EVICTING", "LET_GO", "GUEST"]


class EntryState(IntEnum):
    FREE = 0
    RESERVED = 1
    COMMITTED = 2
    DOOMED = 3
    QUARANTINED = 4
    PROMOTING = 5  # slot allocated, bytes being read back from the disk tier


@dataclass(eq=False)
class Namespace:
    """A namespace's index and its counters. `name` is what RPCs use; the rest describes it."""

    id: int
    name: str
    model: str = ""
    layout_digest: str = ""
    tenant: str = ""
    disk_codec: str = "none"
    recovered: bool = False  # known only from the disk tier after a restart; the next registration describes it
    index: dict[bytes, int] = field(default_factory=dict)
    blocks: int = 0
    bytes: int = 0
    lookup_keys: int = 0
    hit_keys: int = 0
    puts: int = 0
    tokens_per_block: int = 0  # 0: unknown; else lookups and hits are also reported in tokens
    hit_keys_disk: int = 0     # of hit_keys, those found on the disk tier (for per-tier token metrics)
    hit_keys_peer: int = 0     # of hit_keys, those found on peers (Lookups without lease: being prefetched)


_COLUMNS: tuple[tuple[str, type], ...] = (
    ("offset", np.int64),
    ("size", np.int64),
    ("checksum", np.uint64),
    ("leases", np.int32),
    ("created", np.float32),
    ("pins", np.uint16),
    ("ns", np.uint16),
    ("state", np.uint8),
    ("flags", np.uint8),
    ("seen", np.uint8),
    ("serial", np.uint32),  # which use of a reused id this is (the shared key index names entries by id + serial)
)

_RESERVED, _COMMITTED = int(EntryState.RESERVED), int(EntryState.COMMITTED)  # plain ints: cheaper numpy writes
_BATCH_MIN = 8  # add_many, mark_committed: from this many entries on, one numpy call per column is cheaper

ON_DISK = 1
QUEUED = 2
WRITING = 4
DISK_DROPPED = 8
EVICTING = 16
LET_GO = 32
GUEST = 64


class CatalogMirror(Protocol):
    """What the catalog tells the shared key index (engine/key_mirror.py)."""

    def added(self, eids: Sequence[int], ns: Namespace | None = None) -> None: ...  # just made COMMITTED (in RAM)
    def removed(self, ns: Namespace, keys: list[bytes]) -> None: ...  # COMMITTED entries about to be unindexed
    def bind_deferred(self) -> None: ...  # a Store answers before its keys are indexed (engine/writes.py)
    def bind_done(self) -> None: ...  # and they are now


class CatalogJournal(Protocol):
    """What the catalog tells the RAM journal (engine/journal_link.py)."""

    def committed(self, eids: Sequence[int]) -> None: ...  # just made COMMITTED: its record is written later
    def removed(self, eids: Sequence[int]) -> None: ...  # COMMITTED entries about to be unindexed: records cleared
    def namespace(self, ns: Namespace) -> None: ...  # a namespace added or described anew


class Catalog:
    """Entry columns plus the namespaces' indexes. Columns are public for vectorized reads by the engine."""

    MAX_NAMESPACES = 65535

    offset: np.ndarray
    size: np.ndarray
    checksum: np.ndarray
    leases: np.ndarray
    created: np.ndarray
    pins: np.ndarray
    ns: np.ndarray
    state: np.ndarray
    flags: np.ndarray
    seen: np.ndarray
    serial: np.ndarray

    def __init__(self, initial_capacity: int = 1024) -> None:
        self._capacity = max(16, initial_capacity)
        for name, dtype in _COLUMNS:
            setattr(self, name, np.zeros(self._capacity, dtype=dtype))
        self.keys: list[bytes | None] = []
        self._free_ids: list[int] = []
        self.namespaces: list[Namespace] = []
        self.by_name: dict[str, Namespace] = {}
        self._epoch = time.monotonic()
        self._serial = 0
        # the shared key index's writer (engine/key_mirror.py): told which entries become and stop being
        # committed in RAM; None when the daemon runs without it
        self.mirror: CatalogMirror | None = None
        # the RAM journal's writer (engine/journal_link.py): which entries are committed, for a successor
        self.journal: CatalogJournal | None = None

    # -- namespaces -------------------------------------------------------------------------------------
    def add_namespace(self, name: str, model: str, layout_digest: str, tenant: str, disk_codec: str = "none",
                      recovered: bool = False) -> Namespace:
        if len(self.namespaces) >= self.MAX_NAMESPACES:
            raise OverflowError(f"more than {self.MAX_NAMESPACES} namespaces")
        ns = Namespace(len(self.namespaces), name, model, layout_digest, tenant, disk_codec, recovered)
        self.namespaces.append(ns)
        self.by_name[name] = ns
        if self.journal is not None:
            self.journal.namespace(ns)
        return ns

    def namespace_changed(self, ns: Namespace) -> None:
        """A namespace's description changed (a recovered one registered, its tenant assigned)."""
        if self.journal is not None:
            self.journal.namespace(ns)

    # -- entries ----------------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the catalog was created (what the `created` column holds)."""
        return time.monotonic() - self._epoch

    def add(self, ns: Namespace, key: bytes, offset: int, size: int) -> int:
        """A new RESERVED entry, indexed under `key`."""
        if self._free_ids:
            eid = self._free_ids.pop()
            self.keys[eid] = key
        else:
            eid = len(self.keys)
            if eid == self._capacity:
                self._grow()
            self.keys.append(key)
        self.offset[eid] = offset
        self.size[eid] = size
        self.checksum[eid] = 0
        self.leases[eid] = 0
        self.pins[eid] = 0
        self.ns[eid] = ns.id
        self.state[eid] = _RESERVED
        self.flags[eid] = 0
        self.seen[eid] = 0
        self._serial = (self._serial + 1) & 0xFFFFFFFF
        self.serial[eid] = self._serial
        self.created[eid] = self.now()
        ns.index[key] = eid
        return eid

    def add_many(self, ns: Namespace, keys: Sequence[bytes], offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """`add` of each (key, offset, size) in order: the same ids, columns and index, one numpy call a column.

        The ids are the ones successive `add` calls would hand out: reused ids from the end of the free list
        first, then new ones; `keys` must be distinct (a write batch). Below a few items, `add` of each is
        cheaper (a numpy scalar write costs a fraction of a call with an index array)."""
        free, n = self._free_ids, len(keys)
        if n < _BATCH_MIN:
            return [self.add(ns, key, off, size) for key, off, size in zip(keys, offsets, sizes)]
        reused = min(n, len(free))
        eids = free[len(free) - reused:][::-1]
        del free[len(free) - reused:]
        for eid, key in zip(eids, keys):
            self.keys[eid] = key
        if reused < n:
            start = len(self.keys)
            while start + n - reused > self._capacity:
                self._grow()
            eids += range(start, start + n - reused)
            self.keys += keys[reused:]
        ids = np.array(eids, dtype=np.int64)
        self.offset[ids] = offsets
        self.size[ids] = sizes
        for name in ("checksum", "leases", "pins", "flags", "seen"):
            getattr(self, name)[ids] = 0
        self.ns[ids] = ns.id
        self.state[ids] = _RESERVED
        self.serial[ids] = (np.arange(self._serial + 1, self._serial + 1 + n, dtype=np.uint64) & 0xFFFFFFFF)
        self._serial = (self._serial + n) & 0xFFFFFFFF
        self.created[ids] = self.now()
        ns.index.update(zip(keys, eids))
        return eids

    def restore(self, eids: np.ndarray, ns_ids: np.ndarray, keys: Sequence[bytes], offsets: np.ndarray,
                sizes: np.ndarray, checksums: np.ndarray, serials: np.ndarray, states: np.ndarray,
                serial: int = 0) -> None:
        """Entries of a previous daemon at their own ids and serials (a hand-over restart, adoption.py), on a
        catalog without entries: same ids, so the shared key index's entries and clients' lookups by id stay
        true. RESERVED and COMMITTED entries are indexed under their keys; the others (DOOMED) are not. Every
        id below the highest that is not placed is free. No hook is told: the adoption says what changed."""
        if self.keys:
            raise ValueError("restore needs a catalog without entries")
        ids = np.asarray(eids, dtype=np.int64)
        top = int(ids.max()) + 1 if len(ids) else 0
        while top > self._capacity:
            self._grow()
        self.keys = [None] * top
        for eid, key in zip(ids.tolist(), keys):
            self.keys[eid] = key
        self.offset[ids], self.size[ids], self.checksum[ids] = offsets, sizes, checksums
        self.serial[ids], self.ns[ids], self.state[ids] = serials, ns_ids, states
        for name in ("leases", "pins", "flags"):
            getattr(self, name)[ids] = 0
        self.seen[ids] = 1
        self.created[ids] = self.now()
        visible = (states == _RESERVED) | (states == _COMMITTED)
        for eid, ns_id, key in zip(ids[visible].tolist(), np.asarray(ns_ids)[visible].tolist(),
                                   [k for k, v in zip(keys, visible.tolist()) if v]):
            self.namespaces[ns_id].index[key] = eid
        placed = set(ids.tolist())
        self._free_ids = [i for i in range(top - 1, -1, -1) if i not in placed]
        self._serial = max(serial, int(np.max(serials)) if len(ids) else 0) & 0xFFFFFFFF

    def mark_committed(self, eids: list[int], checksums: Sequence[int] = (), ns: Namespace | None = None) -> int:
        """Set entries COMMITTED, created now, with their checksums (if given, one per entry); their total size.
        `ns`: their namespace, if the caller knows it (the key index then need not look it up)."""
        now = self.now()
        if len(eids) < _BATCH_MIN:
            total = 0
            for i, eid in enumerate(eids):
                self.state[eid] = _COMMITTED
                self.created[eid] = now
                if checksums:
                    self.checksum[eid] = checksums[i]
                total += int(self.size[eid])
        else:
            ids = np.array(eids, dtype=np.int64)
            self.state[ids] = _COMMITTED
            self.created[ids] = now
            if checksums:
                self.checksum[ids] = np.array(checksums, dtype=np.uint64)
            total = sum(self.size[ids].tolist())
        if self.mirror is not None:
            self.mirror.added(eids, ns)
        if self.journal is not None:
            self.journal.committed(eids)
        return total

    def unindex(self, eid: int) -> None:
        """Make the entry invisible to lookups (its slot stays allocated)."""
        key = self.keys[eid]
        ns = self.namespaces[int(self.ns[eid])]
        if key is not None and ns.index.get(key) == eid:
            if self.state[eid] == _COMMITTED:
                if self.mirror is not None:
                    self.mirror.removed(ns, [key])
                if self.journal is not None:
                    self.journal.removed([eid])
            del ns.index[key]

    def unindex_many(self, ns: Namespace, eids: list[int], keys: list[bytes]) -> None:
        """`unindex` of entries of one namespace (`keys`: theirs), with one call to the key index."""
        index, state, gone, gone_ids = ns.index, self.state, [], []
        for eid, key in zip(eids, keys):
            if index.get(key) == eid:
                if state[eid] == _COMMITTED:
                    gone.append(key)
                    gone_ids.append(eid)
                del index[key]
        if gone and self.mirror is not None:
            self.mirror.removed(ns, gone)
        if gone_ids and self.journal is not None:
            self.journal.removed(gone_ids)

    def drop_many(self, eids: list[int]) -> None:
        """`drop` of each."""
        self.state[eids] = EntryState.FREE
        keys = self.keys
        for eid in eids:
            keys[eid] = None
        self._free_ids.extend(eids)

    def drop(self, eid: int) -> None:
        """Forget an unindexed entry whose slot the engine has already freed; its id is reused."""
        self.state[eid] = EntryState.FREE
        self.keys[eid] = None
        self._free_ids.append(eid)

    def namespace_of(self, eid: int) -> Namespace:
        return self.namespaces[int(self.ns[eid])]

    def __len__(self) -> int:
        return len(self.keys) - len(self._free_ids)

    def live_ids(self) -> np.ndarray:
        """Ids of every entry that is not FREE (for stats; O(entries))."""
        n = len(self.keys)
        return np.flatnonzero(self.state[:n] != EntryState.FREE)

    def _grow(self) -> None:
        new = self._capacity * 2
        for name, _ in _COLUMNS:
            old = getattr(self, name)
            col = np.zeros(new, dtype=old.dtype)
            col[: self._capacity] = old
            setattr(self, name, col)
        self._capacity = new

    def memory_bytes(self) -> int:
        """Bytes held by the columns (not the dicts); for tests and the RSS budget."""
        return sum(getattr(self, name).nbytes for name, _ in _COLUMNS)
