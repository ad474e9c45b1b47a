"""Keeps each tenant's shared key index (kvstore/fastpath/key_index.py) equal to what a Lookup finds in RAM.

The catalog calls `added` when entries become COMMITTED (a commit, a promotion from disk) and `removed` just
before a COMMITTED entry is unindexed (eviction, deletion), always under the engine's lock, so the table
never says "in RAM" about a key a Lookup would not find there for longer than that lock is held. Which
table: the namespace's tenant's when the daemon has tokens (each tenant sees only its own keys), else the one
shared table. A namespace whose tenant changes (a recovered namespace adopted by a registration) has its keys
moved to the new tenant's table before the next change is written.

Tables are created on first use, by the engine (a write) or by the same-node socket (a client asking for its
tenant's table), hence the lock around the dict.

Whether a key's absence from a table is an answer (key_index.py): `authoritative` says the daemon has RAM only
(no disk tier, no peers); a table that once had to skip a key stops being so for good. `bind_deferred` and
`bind_done` bracket a Store whose keys are indexed after its reply (engine/writes.py), in every table: a
client then asks the daemon about absent keys until the binding is done.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.arena.backing import SHARED_DOMAIN
from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.fastpath.key_index import IndexTable, capacity_for

__all__ = ["KeyIndexMirror"]

_COMMITTED = int(EntryState.COMMITTED)
_GATHER_MIN = 8  # from this many ids on, one numpy gather a column beats a scalar read an id


class KeyIndexMirror:
    def __init__(self, cat: Catalog, entries: int, incarnation: int, per_tenant: bool,
                 authoritative: bool = False, adopted: dict[str, IndexTable] | None = None) -> None:
        """`entries`: how many keys one tenant's table indexes at most (beyond, keys stay unindexed and clients
        ask the daemon for them). `authoritative`: RAM is the daemon's only tier (see the module docstring).
        `adopted`: a predecessor's tables by domain (a hand-over restart: its clients keep their mappings),
        with their counters carried on."""
        self._cat = cat
        self._capacity = capacity_for(entries)
        self._incarnation = incarnation
        self._per_tenant = per_tenant
        self._tables: dict[str, IndexTable] = {}
        self._lock = threading.Lock()
        self._domain_of: dict[int, str] = {}  # namespace id -> the table its keys are in
        self.unindexed = 0  # keys the tables had no room for (counted, not an error)
        self._authoritative = authoritative
        self._deferred = self._bound = 0  # Stores bound after their reply: begun, done (every table shows both)
        for domain, table in (adopted or {}).items():
            authority, deferred, bound = table.words()
            self._deferred, self._bound = max(self._deferred, deferred), max(self._bound, bound)
            self._authoritative = self._authoritative and bool(authority)
            self._tables[domain] = table
        for table in self._tables.values():
            table.set_binds(self._deferred, self._bound)
            table.set_authority(self._authoritative)

    def domain(self, tenant: str) -> str:
        """The table a caller of `tenant` reads (and a namespace of that tenant is written to)."""
        return tenant if self._per_tenant else SHARED_DOMAIN

    def table(self, domain: str) -> IndexTable:
        with self._lock:
            t = self._tables.get(domain)
            if t is None:
                t = self._tables[domain] = IndexTable(domain or "shared", self._capacity, self._incarnation)
                t.set_binds(self._deferred, self._bound)
                t.set_authority(self._authoritative)
            return t

    def reader_fd(self, tenant: str) -> int:
        """A read-only descriptor of the table a caller of `tenant` probes (the caller closes it)."""
        return self.table(self.domain(tenant)).reader_fd()

    def added(self, eids: Sequence[int], ns: Namespace | None = None) -> None:
        """`ns`: the namespace of every entry, when the caller knows it (a commit: one namespace); else looked up.
        Why the two ways to read the columns: a commit's handful of ids costs less as scalar reads than as numpy
        gathers (each ~1.5 us hot, several times that after a client's copy has flushed the caches)."""
        if not len(eids):
            return
        cat = self._cat
        ids = [int(e) for e in eids]  # plain ints: the native insert takes no numpy scalars
        if ns is None:
            spaces = cat.ns[ids]
            if len(ids) > 1 and not (spaces == spaces[0]).all():  # never from one commit; one namespace at a time
                for e in ids:
                    self.added([e])
                return
            ns = cat.namespaces[int(spaces[0])]
        keys = [cat.keys[e] for e in ids]
        if len(ids) < _GATHER_MIN:
            cols = [[int(col[e]) for e in ids] for col in (cat.serial, cat.size, cat.offset, cat.checksum)]
        else:
            cols = [col[ids].tolist() for col in (cat.serial, cat.size, cat.offset, cat.checksum)]
        table = self._table_of(ns)
        written = table.insert(ns.name, keys, ids, *cols)  # type: ignore[arg-type]  # committed entries have keys
        if written < len(ids):
            self.unindexed += len(ids) - written
            table.set_authority(False)  # for good: a skipped key may stay in RAM for as long as it likes

    def bind_deferred(self) -> None:
        """A Store is about to answer before its keys are indexed (under the engine's lock, before the reply; on
        every Store's reply path, so one word written a table). Counted and written under the tables' lock: a
        table made meanwhile by a client's request (not under the engine's lock) starts from the count after."""
        with self._lock:
            self._deferred += 1
            for t in self._tables.values():
                t.set_deferred(self._deferred)

    def bind_done(self) -> None:
        """That Store's keys are indexed now (or its binding failed: nothing of it will be found either way)."""
        with self._lock:
            self._bound += 1
            for t in self._tables.values():
                t.set_bound(self._bound)

    def removed(self, ns: Namespace, keys: list[bytes]) -> None:
        self._table_of(ns).remove(ns.name, keys)

    def _table_of(self, ns: Namespace) -> IndexTable:
        domain = self.domain(ns.tenant)
        old = self._domain_of.get(ns.id)
        if old is not None and old != domain:  # the namespace changed hands: its keys move with it
            keys = [k for k, e in ns.index.items() if self._cat.state[e] == _COMMITTED]
            self.table(old).remove(ns.name, keys)
            self._domain_of[ns.id] = domain  # before `added`, which comes back here
            eids = [ns.index[k] for k in keys]
            if eids:
                self.added(eids)
        self._domain_of[ns.id] = domain
        return self.table(domain)

    def tables(self) -> dict[str, IndexTable]:
        """Every table by domain (a hand-over sends them to the successor)."""
        with self._lock:
            return dict(self._tables)

    def counts(self) -> dict[str, int]:
        """Keys indexed per table."""
        with self._lock:
            return {d: t.count for d, t in self._tables.items()}

    def status(self) -> dict[str, int]:
        """For the metrics: tables, keys indexed in all of them, keys that found their table 3/4 full."""
        counts = self.counts()
        return {"key_index_tables": len(counts), "key_index_keys": sum(counts.values()),
                "key_index_unindexed": self.unindexed}

    def close(self) -> None:
        with self._lock:
            for t in self._tables.values():
                t.close()
            self._tables.clear()
