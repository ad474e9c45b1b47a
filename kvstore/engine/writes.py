"""Writes: Reserve and Commit, and Store of blocks a client already copied into spare slots (spares.py).

One implementation of what a write does, whichever way it came: `plan` decides which keys need a slot (not in
RAM, not on disk), `_committed` is everything that follows a commit (the policy, deferred hints, KV events,
pushes to peers, disk admission, the watermarks). A Store is a Reserve and a Commit in one step, with the slots
named by the client instead of allocated now. Called under the engine's lock. With `settle_later`, a Commit
leaves the watermark eviction to `later` (EngineLock.defer: after its reply, before any other call), and a Store
leaves all of what its reply does not carry: the reply needs the outcomes, the slots taken and the new spare
slots, while binding the keys to their slots (the catalog, the policy, the key index, events, the disk tier and
the eviction) is the larger half of its work, and no other call can see the engine before it is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.engine.catalog import Catalog, Namespace
from kvstore.engine.config import EngineConfig
from kvstore.engine.counters import Counters
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.events import STORED, EventBus
from kvstore.engine.hints import Hints
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.reservations import ReservationTable, plan
from kvstore.engine.results import Filled, ReserveResult, StoreResult
from kvstore.engine.spares import SpareSlots
from kvstore.vocab import ReserveOutcome, Tier

__all__ = ["Writes", "RemoteHooks"]


class RemoteHooks(Protocol):
    """What the engine asks of the peer tier (kvstore.peer.PeerCluster); both are called with keys only."""

    def fill(self, namespace: str, keys: Sequence[bytes]) -> Filled: ...  # before a leased Lookup, no lock held
    def prefetch(self, namespace: str, keys: Sequence[bytes], prefix: bool) -> list[bool]: ...  # one without lease
    def committed(self, reservation_id: int, namespace: str, keys: Sequence[bytes]) -> None: ...  # under the lock
    def held_elsewhere(self, namespace: str, keys: Sequence[bytes]) -> list[bool]: ...  # Exists(cluster), no lock
    def loaded(self, namespace: str, keys: Sequence[bytes]) -> None: ...  # after a leased Lookup, no lock
    def claim(self, namespace: str, keys: Sequence[bytes], claimant: bytes,
              ttl_ms: int) -> dict[bytes, int]: ...  # Claim at the keys' owners, no lock: key -> HELD/PENDING


class Writes:
    def __init__(self, config: EngineConfig, cat: Catalog, ram: RamSpace, reservations: ReservationTable,
                 spares: SpareSlots, disk: DiskLink, hints: Hints, events: EventBus, counters: Counters,
                 later: Callable[[Callable[[], object]], None]) -> None:
        self._config = config
        self._cat = cat
        self._ram = ram
        self._reservations = reservations
        self._spares = spares
        self._disk = disk
        self._hints = hints
        self._events = events
        self._counters = counters
        self._later = later
        self.remote: RemoteHooks | None = None  # the peer tier (Engine.attach_remote)

    def plan(self, ns: Namespace, keys: Sequence[bytes]) -> tuple[list[int], list[int], set[int]]:
        """reservations.plan, then the disk tier: a key present on disk needs no write either."""
        outcomes, todo, keep = plan(self._cat, ns, keys)
        if todo and self._disk.store is not None:
            on_disk = self._disk.contains_many(ns.name, [keys[i] for i in todo])
            for i, length in zip(list(todo), on_disk):
                if length:
                    outcomes[i] = ReserveOutcome.ALREADY_PRESENT
                    todo.remove(i)
        return outcomes, todo, keep

    def reserve(self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int]) -> ReserveResult:
        self._counters.reserve_calls += 1
        outcomes, todo, keep = self.plan(ns, keys)
        if not todo:
            return ReserveResult(0, outcomes, [0] * len(keys), 0)
        offsets = self._ram.allocate_all(sizes, todo, keep, ns.tenant)
        eids = self._add(ns, keys, sizes, offsets, todo)
        rid = self._reservations.add(ns, eids)
        return ReserveResult(rid, outcomes, offsets, self._reservations.expires_in_ms)

    def commit(self, reservation_id: int, checksums: Sequence[int], settle_later: bool = False) -> int:
        ns, eids = self._reservations.take(reservation_id, len(checksums))
        self._committed(reservation_id, ns, eids, checksums, settle_later)
        return len(eids)

    def store(self, owner: int, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int],
              offsets: Sequence[int], settle_later: bool = False) -> StoreResult:
        """Bind each new key to the spare slot the client copied it into, and commit them; a new spare slot for
        each one used. Counted as one Reserve and one Commit of the stored keys."""
        self._spares.check(owner, offsets, sizes, ns.tenant)
        self._counters.reserve_calls += 1
        outcomes, todo, present = self.plan(ns, keys)
        refill = [0] * len(keys)
        if not todo:
            return StoreResult(outcomes, 0, refill)
        self._spares.take(owner, [offsets[i] for i in todo])
        keep = present  # blocks found are not evicted for their successors' slots (ALREADY_PRESENT stays true)
        if settle_later:  # the new entries exist once `later` runs, so this grant cannot evict them either
            self._bind_after_reply(ns, keys, sizes, offsets, todo)
        else:
            keep = present.union(self._bind(ns, keys, sizes, offsets, todo))
        for group in self._by_class(sizes, todo):  # one grant a size class; one a slot only when that is refused
            got = self._spares.grant(owner, sizes[group[0]], len(group), ns.tenant, keep)[1]
            for j, i in enumerate(group):
                one = got[j:j + 1] if got else self._spares.grant(owner, sizes[i], 1, ns.tenant, keep)[1]
                refill[i] = one[0] if one else 0
        return StoreResult(outcomes, len(todo), refill)

    def _by_class(self, sizes: Sequence[int], todo: list[int]) -> list[list[int]]:
        """The indices in `todo` grouped by the size class of their blocks, in order within a class unless its
        blocks differ in size."""
        if sizes.count(sizes[0]) == len(sizes):  # one size: the usual put
            return [todo]
        by_size: dict[int, list[int]] = {}
        for i in todo:
            by_size.setdefault(sizes[i], []).append(i)
        by_class: dict[int, list[int]] = {}
        for size, group in by_size.items():
            by_class.setdefault(self._ram.slot_bytes(size), []).extend(group)
        return list(by_class.values())

    def _bind_after_reply(self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int],
                          todo: list[int]) -> None:
        """`_bind` once the reply is out; the shared key index hears of it first, so that until the keys are
        there no client takes their absence for an answer (key_mirror.py)."""
        mirror = self._cat.mirror
        if mirror is None:
            self._later(lambda: self._bind(ns, keys, sizes, offsets, todo))
            return
        mirror.bind_deferred()

        def bind() -> None:
            try:
                self._bind(ns, keys, sizes, offsets, todo)
            finally:
                mirror.bind_done()
        self._later(bind)

    def _bind(self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int],
              todo: list[int]) -> list[int]:
        """A Store's keys[todo] become COMMITTED entries at their slots (after its reply, when deferred: then
        its eviction runs here too, as nothing is left for after it)."""
        eids = self._add(ns, keys, sizes, offsets, todo)
        self._committed(0, ns, eids, (), False)
        return eids

    def _add(self, ns: Namespace, keys: Sequence[bytes], sizes: Sequence[int], offsets: Sequence[int],
             todo: list[int]) -> list[int]:
        """RESERVED entries for keys[todo] at their offsets."""
        if len(todo) == len(keys):
            eids = self._cat.add_many(ns, keys, offsets, sizes)
        else:  # the keys to add, in order
            eids = self._cat.add_many(ns, [keys[i] for i in todo], [offsets[i] for i in todo],
                                      [sizes[i] for i in todo])
        self._counters.reserved_blocks += len(eids)
        return eids

    def _committed(self, reservation_id: int, ns: Namespace, eids: list[int], checksums: Sequence[int],
                   settle_later: bool) -> None:
        self._ram.commit(ns, eids, checksums)
        self._hints.committed(eids)  # hints that reached these blocks while they were being written
        if self._events.subscribers:
            self._events.publish(STORED, ns.name, [self._cat.keys[e] for e in eids], Tier.RAM)  # type: ignore[misc]  # a live entry's key is set (None only once dropped)
        if self.remote is not None:  # queues pushes to owners; never blocks
            self.remote.committed(reservation_id, ns.name, [self._cat.keys[e] for e in eids])  # type: ignore[misc]  # a live entry's key is set (None only once dropped)
        self._disk.on_commit(eids)
        if settle_later:
            self._later(self._ram.enforce_watermarks)
        else:
            self._ram.enforce_watermarks()
