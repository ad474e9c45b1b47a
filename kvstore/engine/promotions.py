"""Promotions: blocks found only on disk, read back into arena slots. A Lookup starts them; a get waits for them.

A promotion needs a slot (`start`): a free one, or one an eviction makes. Under disk_write=evict the victim may
have to be written to disk first (ram_space.py: PENDING); the promotion then waits for room, its entry
PROMOTING with no slot yet (offset -1), so a second Lookup of the key joins it rather than starting another.

The promotions one Lookup starts form a group (`begin` ... `end`): when any of them waits for room, none is
read until all have a slot, and then all are read in the chain's order. Why: a victim's write may reclaim a
disk segment, and a read that raced those writes would find its record or not depending on which thread ran
first; reading the group only after every write it set off makes what it finds depend on the order of calls
alone (the replay's exact simulator relies on it), and a read never races a reclamation its own Lookup caused.

Room comes back as write-backs land (DiskLink.finish_writes calls `serve`): waiting groups, oldest first, take
free slots, without evicting while write-backs are still in flight (those are making the room), else with
eviction as any allocation (which may start more write-backs). A promotion that finds no room at all fails:
a miss, counted in promotion_failures, as before.

`finish` is the promoter's report (DiskLink.finish_promotion holds the engine's lock): the entry is committed
into RAM and the policy, or its slot goes back. Called under the engine's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvstore.engine.catalog import ON_DISK, Catalog, EntryState, Namespace
from kvstore.engine.counters import Counters
from kvstore.engine.events import MOVED, EventBus
from kvstore.engine.movement import Mover, Promotion
from kvstore.engine.ram_space import PENDING, RamSpace
from kvstore.tiers.disk import DiskStatus
from kvstore.vocab import Tier

__all__ = ["Promotions"]

_COMMITTED = int(EntryState.COMMITTED)
_PROMOTING = int(EntryState.PROMOTING)


class _Group:
    """One Lookup's promotions that wait for room, with what making room must not evict."""

    __slots__ = ("promos", "keep", "tenants")

    def __init__(self, promos: list[Promotion], keep: set[int], tenants: list[str]) -> None:
        self.promos, self.keep, self.tenants = promos, keep, tenants


class Promotions:
    """Promotions in flight (by entry id) and the groups waiting for room. Called under the engine's lock."""

    def __init__(self, cat: Catalog, ram: RamSpace, counters: Counters, events: EventBus, mover: Mover | None,
                 arena_address: int) -> None:
        self._cat, self._ram, self._counters, self._events = cat, ram, counters, events
        self._mover = mover
        self._arena_address = arena_address
        self._inflight: dict[int, Promotion] = {}
        self._started: list[Promotion] | None = None  # the current Lookup's (between begin and end)
        self._tenants: list[str] = []
        self._keep: set[int] = set()
        self._waiting: deque[_Group] = deque()
        self.on_promoted: Callable[[int, bool], None] | None = None  # hints.py: (entry, landed)

    def use_mover(self, mover: Mover) -> None:
        """The disk link's new I/O threads (after a hand-over that failed: disk_link.restart)."""
        self._mover = mover

    def __len__(self) -> int:
        """Promotions started and not finished (reading, queued or waiting for room)."""
        return len(self._inflight)

    def get(self, eid: int) -> Promotion | None:
        return self._inflight.get(eid)

    # -- a Lookup's group -----------------------------------------------------------------------------
    def begin(self, keep: set[int]) -> None:
        self._started, self._tenants, self._keep = [], [], keep

    def start(self, ns: Namespace, key: bytes, length: int) -> Promotion | None:
        """An entry for `key` and a slot for it, or the promise of one; None: no room at all (counted)."""
        assert self._mover is not None and self._started is not None, "start() belongs between begin() and end()"
        off = self._ram.allocate(length, self._keep, ns.tenant)
        if off is None:
            self._counters.promotion_failures += 1
            return None
        cat = self._cat
        eid = cat.add(ns, key, off, length)
        cat.state[eid] = _PROMOTING
        cat.flags[eid] = ON_DISK
        p = Promotion(eid, ns.name, key, self._arena_address + off if off != PENDING else 0,
                      self._ram.slot_bytes(length), length)
        self._inflight[eid] = p
        self._started.append(p)
        self._tenants.append(ns.tenant)
        self._counters.promotions += 1
        return p

    def end(self) -> None:
        """Queue the group's reads, or park the group until every promotion in it has room."""
        group, self._started = self._started or [], None
        if not group:
            return
        if any(not p.address for p in group):
            self._waiting.append(_Group(group, self._keep, self._tenants))
        else:
            self._read(group)

    def cancel(self, eid: int) -> None:
        """Deleted while being promoted: the promoter (or `serve`) frees what it holds when it gets to it."""
        self._inflight[eid].cancelled = True
        self._cat.unindex(eid)

    # -- room -----------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Write-backs landed: give the waiting groups, oldest first, the room they need (module docstring)."""
        while self._waiting:
            g = self._waiting[0]
            for p, tenant in zip(g.promos, g.tenants):
                if p.address or p.done.is_set():
                    continue
                if p.cancelled:  # deleted while it waited: it never had a slot
                    self._fail(p, DiskStatus.NOT_FOUND)
                    continue
                off = self._room(p.length, g.keep, tenant)
                if off == PENDING:
                    return  # this group waits on; so do the ones after it
                if off is None:
                    self._fail(p, DiskStatus.NOT_FOUND)
                    continue
                self._cat.offset[p.eid] = off
                p.address = self._arena_address + off
            self._waiting.popleft()
            self._read([p for p in g.promos if p.address and not p.done.is_set()])

    def _room(self, length: int, keep: set[int], tenant: str) -> int | None:
        """A free slot; evicting only when no write-back is in flight (those are making room already)."""
        if self._ram.incoming_bytes:
            off = self._ram.allocator.allocate(length, self._ram.domain(tenant))
            return PENDING if off is None else off
        return self._ram.allocate(length, keep, tenant)

    def _read(self, group: list[Promotion]) -> None:
        if group:
            assert self._mover is not None
            self._mover.enqueue_promotions(group)

    # -- the promoter's report ------------------------------------------------------------------------
    def finish(self, p: Promotion, status: DiskStatus) -> None:
        """The read into the slot ended: commit the entry, or give the slot back (counted)."""
        cat = self._cat
        self._inflight.pop(p.eid, None)
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
            return
        if alive:
            if self.on_promoted is not None:
                self.on_promoted(p.eid, False)
            cat.unindex(p.eid)
            self._ram.free(p.eid)
        self._counters.promotion_failures += 1
        if status is DiskStatus.CHECKSUM_ERROR:
            self._counters.checksum_failures += 1

    def _fail(self, p: Promotion, status: DiskStatus) -> None:
        """A waiting promotion that gets no slot: its entry goes (it never had a slot) and its waiter is woken."""
        cat = self._cat
        self._inflight.pop(p.eid, None)
        if cat.state[p.eid] == _PROMOTING and cat.keys[p.eid] == p.key:
            if self.on_promoted is not None:
                self.on_promoted(p.eid, False)
            cat.unindex(p.eid)
            cat.drop(p.eid)
        self._counters.promotion_failures += 1
        p.done.set()
