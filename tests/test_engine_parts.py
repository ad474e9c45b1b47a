"""The engine's parts work on their own, with no Engine around them (the composition the engine is built from).

Each test builds a real catalog, allocator and policy, and drives one part through a commented script with
exact values. The Engine-level behaviour is covered by test_engine*.py; these pin down each part's contract.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.catalog import Catalog, EntryState
from kvstore.engine.config import EngineConfig
from kvstore.engine.counters import Counters
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.engine_lock import EngineLock
from kvstore.engine.events import EventBus
from kvstore.engine.leases import LeaseTable
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.reservations import ReservationTable, plan
from kvstore.errors import InvalidRequestError, ReservationClosedError, StoreFullError, UnknownReservationError
from kvstore.policies import make_policy
from kvstore.vocab import ReserveOutcome

MiB = 1 << 20
CFG = EngineConfig(max_block_bytes=MiB, high_watermark=1.0, low_watermark=1.0, quarantine_s=5.0,
                   reservation_ttl_s=10.0)


class Parts:
    """A catalog with one namespace, a 4-slab arena of 1 MiB slots, LRU, and the parts over them."""

    def __init__(self) -> None:
        self.layout = ArenaLayout.for_capacity("parts", 4 * MiB, MiB)
        self.gens = np.zeros(self.layout.gen_table_bytes // 8, dtype=np.uint64)
        self.alloc = SlabAllocator(self.layout.data_offset, self.layout.data_bytes, MiB)
        self.cat = Catalog()
        self.ns = self.cat.add_namespace("m@1/parts", "", "", "")
        self.counters = Counters()
        self.ram = RamSpace(CFG, self.cat, self.layout, self.gens, self.alloc, make_policy("lru"), None,
                            self.counters, EventBus())
        self.leases = LeaseTable(self.cat, CFG.lease_ttl_s, self.ram.free, self.counters)
        self.reservations = ReservationTable(self.cat, CFG, self.ram.free, self.counters)

    def put(self, key: bytes) -> int:
        """A committed 1 MiB block under `key`; its entry id."""
        off = self.ram.allocate(MiB, set(), "")
        assert off is not None
        eid = self.cat.add(self.ns, key, off, MiB)
        self.ram.commit(self.ns, [eid], ())
        return eid

    def gen(self, eid_offset: int) -> int:
        return int(self.gens[self.layout.generation_index(eid_offset)])


def test_ram_space_evicts_the_least_recent_unheld_block_and_bumps_its_generation() -> None:
    p = Parts()
    a, b, c, d = (p.put(k) for k in (b"a", b"b", b"c", b"d"))   # the arena is full: 4 of 4 slots
    off_a, off_b, off_c = (int(p.cat.offset[e]) for e in (a, b, c))
    p.ram.record_hits(np.array([a], dtype=np.int64))             # a is now more recent than b, c, d
    p.leases.hold(np.array([b], dtype=np.int64))                 # b is held: not evictable
    off = p.ram.allocate(MiB, set(), "")                         # evicts c: the LRU unheld block
    assert off == off_c
    assert sorted(p.ns.index) == [b"a", b"b", b"d"] and (p.ns.blocks, p.ns.bytes) == (3, 3 * MiB)
    assert (p.counters.evictions, p.counters.evicted_bytes) == (1, MiB)
    assert p.gen(off) == 1 and (p.gen(off_a), p.gen(off_b)) == (0, 0)
    # with every other block held or kept, the next allocation has no victim: StoreFullError, counted
    p.leases.hold(np.array([a, d], dtype=np.int64))
    with pytest.raises(StoreFullError, match=r"cannot place 1048576 bytes; 4194304 of 4194304 arena bytes"):
        p.ram.allocate_all([MiB], [0], set(), "")
    assert p.counters.store_full == 1


def test_a_block_deleted_while_leased_is_freed_at_its_last_release() -> None:
    p = Parts()
    eid = p.put(b"k")
    off = int(p.cat.offset[eid])
    ids = np.array([eid, eid], dtype=np.int64)                    # two holders: one lease of the id twice
    p.leases.hold(ids)
    lease = p.leases.grant(ids)
    assert p.leases.namespace_of(lease) == "m@1/parts" and len(p.leases) == 1
    p.ram.delete(eid)                                            # DOOMED: invisible, slot still taken
    assert (p.cat.state[eid], p.ns.index, p.alloc.allocated_bytes, p.gen(off)) == (EntryState.DOOMED, {}, MiB, 0)
    assert p.leases.release([lease, lease + 999]) == 1           # an unknown id is ignored
    assert (p.alloc.allocated_bytes, p.gen(off), len(p.cat)) == (0, 1, 0)
    assert p.leases.release([lease]) == 0                        # already released


def test_reservation_table_ends_each_reservation_once_and_quarantines_expired_slots() -> None:
    p = Parts()
    outcomes, todo, keep = plan(p.cat, p.ns, [b"x", b"y"])
    assert (outcomes, todo, keep) == ([ReserveOutcome.RESERVED] * 2, [0, 1], set())
    offsets = p.ram.allocate_all([MiB, MiB], todo, keep, "")
    eids = p.cat.add_many(p.ns, [b"x", b"y"], offsets, [MiB, MiB])
    rid = p.reservations.add(p.ns, eids)
    assert plan(p.cat, p.ns, [b"x", b"z"])[:2] == ([ReserveOutcome.IN_FLIGHT, ReserveOutcome.RESERVED], [1])
    with pytest.raises(InvalidRequestError, match="3 checksums for a reservation of 2 blocks"):
        p.reservations.take(rid, 3)                               # stays open: a corrected commit may follow
    assert p.reservations.namespace_of(rid) == "m@1/parts"
    assert p.reservations.abort(rid) == 2 and p.alloc.allocated_bytes == 0
    with pytest.raises(ReservationClosedError, match=f"reservation {rid} was already aborted$"):
        p.reservations.take(rid, 0)
    with pytest.raises(UnknownReservationError):
        p.reservations.abort(rid + 12345)
    # expiry: the slots stay taken for quarantine_s (a late writer may still copy), then are freed
    offsets = p.ram.allocate_all([MiB], [0], set(), "")
    rid = p.reservations.add(p.ns, p.cat.add_many(p.ns, [b"w"], offsets, [MiB]))
    t0 = 1e9  # far past every deadline (TtlTable uses the monotonic clock)
    p.reservations.expire(t0)
    assert (p.counters.reservation_expirations, p.alloc.allocated_bytes, p.ns.index) == (1, MiB, {})
    p.reservations.expire(t0 + CFG.quarantine_s - 0.5)
    assert p.alloc.allocated_bytes == MiB
    p.reservations.expire(t0 + CFG.quarantine_s)
    assert (p.counters.quarantine_freed, p.alloc.allocated_bytes) == (1, 0)
    with pytest.raises(ReservationClosedError, match="already expired .reservation_ttl_s is 10s"):
        p.reservations.take(rid, 0)


def test_without_a_disk_tier_the_disk_link_says_nothing_is_on_disk_and_queues_nothing() -> None:
    p = Parts()
    link = DiskLink(None, None, cat=p.cat, ram=p.ram, leases=p.leases, counters=p.counters, events=EventBus(),
                    lock=EngineLock())
    eid = p.put(b"k")
    assert link.mover is None and link.contains_many("m@1/parts", [b"k", b"q"]) == [0, 0]
    link.on_commit([eid])
    link.note_hits(np.array([eid], dtype=np.int64))
    assert (int(p.cat.flags[eid]), int(p.cat.seen[eid]), link.queued_writes) == (0, 0, 0)
