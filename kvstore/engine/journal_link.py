"""Keeps the RAM journal (kvstore/arena/journal.py) saying what the catalog's committed RAM entries are.

Why not write each record at its commit: a Store's engine work is a few hundred microseconds, and a record
costs its key packed, its header hashed and, for a block committed without an xxh3, the block hashed. So a
commit only notes its entry ids (`committed`, a list append) and `sync` writes their records later, from the
sweeper thread or when a hand-over asks for it (the records of the last moments are then written in the
hand-over's own pass). A record must never outlive its entry, so `removed` clears records at once: an entry
leaving COMMITTED (evicted, deleted, dropped) is cleared under the same lock that unindexes it, and a record
of an entry freed since it was written no longer matches its slot's generation anyway.

Hashing: a record whose block has no xxh3 cannot be verified by a successor, so its block would be dropped
there. `sync(hash_missing=True)` hashes such blocks outside the engine's lock (a committed block's bytes never
change) and keeps the digest in the catalog too, the way a peer's send does (leases.note_checksums). The
daemon asks for it before a hand-over and, under systemd's fd store, at every sync (a crash keeps what was
hashed); otherwise blocks are hashed only when a hand-over comes.

Called under the engine's lock: `committed`, `removed`, `namespace`, `dirty_ids`, `write_locked`; `sync`
takes the lock itself (twice, hashing between).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.arena.journal import RamJournal
from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.engine.engine_lock import EngineLock
from kvstore.engine.generations import GenerationIndex

__all__ = ["JournalLink", "describe_namespace"]

_COMMITTED = int(EntryState.COMMITTED)
_CHUNK = 4096  # records written per hold of the lock


def describe_namespace(ns: Namespace) -> dict[str, object]:
    """What the journal keeps of a namespace (its entries name it by id)."""
    return {"name": ns.name, "model": ns.model, "layout_digest": ns.layout_digest, "tenant": ns.tenant,
            "disk_codec": ns.disk_codec, "tokens_per_block": ns.tokens_per_block, "recovered": ns.recovered}


@dataclass(frozen=True)
class _Batch:
    eids: np.ndarray
    serials: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    checksums: np.ndarray


class JournalLink:
    def __init__(self, cat: Catalog, journal: RamJournal, generations: np.ndarray, gen_index: GenerationIndex,
                 lock: EngineLock) -> None:
        self._cat = cat
        self.journal = journal
        self._gens = generations
        self._gen_index = gen_index
        self._lock = lock
        self._dirty: list[int] = []
        self.hashed = 0  # blocks hashed for their record (counted for Stats and the logs)
        self.hash_always = False  # a hand-over is under way: every sync hashes (its window then hashes little)

    # -- catalog hooks (under the engine's lock) ------------------------------------------------------------
    def committed(self, eids: Iterable[int]) -> None:
        self._dirty.extend(eids)

    def removed(self, eids: Iterable[int]) -> None:
        self.journal.clear_entries(list(eids))

    def namespace(self, ns: Namespace) -> None:
        self.journal.set_namespace(ns.id, describe_namespace(ns))

    def mark_all(self) -> int:
        """Every committed entry is written again at the next sync (a hand-over's first pass); how many."""
        n = len(self._cat.keys)
        ids = np.flatnonzero(self._cat.state[:n] == _COMMITTED)
        self._dirty.extend(ids.tolist())
        return len(ids)

    def mark_unhashed(self) -> int:
        """Every committed entry without an xxh3 is written again (hashed) at the next pass: a hand-over's last
        pass, since the journal thread may have written records of newer blocks without hashing them."""
        n = len(self._cat.keys)
        cat = self._cat
        ids = np.flatnonzero((cat.state[:n] == _COMMITTED) & (cat.checksum[:n] == 0))
        self._dirty.extend(ids.tolist())
        return len(ids)

    @property
    def pending(self) -> int:
        return len(self._dirty)

    # -- writing --------------------------------------------------------------------------------------------
    def sync(self, view: np.ndarray, hash_missing: bool) -> int:
        """Write the records of entries committed since the last sync, a chunk per hold of the lock; blocks with
        no xxh3 are hashed between (outside the lock) when `hash_missing`. Returns the records written."""
        written = 0
        hash_missing = hash_missing or self.hash_always
        while True:
            with self._lock:
                batch = self._take(_CHUNK)
                if batch is None:
                    return written
                if not hash_missing:
                    written += self._write(batch, {})
                    continue
            digests = self._hash(view, batch)
            with self._lock:
                written += self._write(batch, digests)

    def write_locked(self, view: np.ndarray) -> int:
        """Under the lock, with the engine frozen (a hand-over's last pass): every pending record, hashing the
        blocks that still have no xxh3 (the few committed since the previous pass)."""
        written = 0
        while (batch := self._take(_CHUNK)) is not None:
            written += self._write(batch, self._hash(view, batch))
        return written

    def _take(self, limit: int) -> _Batch | None:
        if not self._dirty:
            return None
        cat = self._cat
        ids = np.unique(np.asarray(self._dirty[:limit], dtype=np.int64))
        del self._dirty[:limit]
        ids = ids[cat.state[ids] == _COMMITTED]
        return _Batch(ids, cat.serial[ids].copy(), cat.offset[ids].copy(), cat.size[ids].copy(),
                      cat.checksum[ids].copy())

    def _hash(self, view: np.ndarray, batch: _Batch) -> dict[int, int]:
        """xxh3 of each block of the batch that has none (entry id -> digest)."""
        out: dict[int, int] = {}
        for eid, off, size, have in zip(batch.eids.tolist(), batch.offsets.tolist(), batch.sizes.tolist(),
                                        batch.checksums.tolist()):
            if not have:
                out[eid] = xxhash.xxh3_64_intdigest(view[off: off + size].data)
        self.hashed += len(out)
        return out

    def _write(self, batch: _Batch, digests: dict[int, int]) -> int:
        """Under the lock: the records of the batch's entries that are still the same committed block."""
        cat = self._cat
        ids = batch.eids
        same = (cat.state[ids] == _COMMITTED) & (cat.serial[ids] == batch.serials)
        ids = ids[same]
        if not len(ids):
            return 0
        if digests:
            for eid in ids.tolist():
                got = digests.get(eid)
                if got and not cat.checksum[eid]:
                    cat.checksum[eid] = got
        offsets = cat.offset[ids]
        gens = self._gens[self._gen_index.of_many(offsets.astype(np.int64))]
        keys = [cat.keys[e] or b"" for e in ids.tolist()]  # committed: every key is set
        self.journal.write_entries(ids, offsets, cat.size[ids], gens, cat.checksum[ids], cat.serial[ids],
                                   cat.ns[ids], keys)
        return len(ids)
