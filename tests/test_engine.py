"""The RAM-tier engine, built from its real small parts (layout math, a numpy generation table, a slab allocator,
a policy) and driven with commented scripts; every check is an exact value.

Default rig: 4 MiB of data in 1 MiB slabs (4 slabs; max_block_bytes = slab), data at DO = 2 MiB, so slab i
starts at DO + i MiB and its generation sits at index i * 256 of the table. Times are explicit: `sweep(now=...)`
gets a monotonic time past the TTL instead of sleeping.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np
import pytest

from kvstore.arena.allocator import ClassUsage, SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.results import ALREADY_PRESENT, IN_FLIGHT, RESERVED, EngineConfig, NamespaceUsage
from kvstore.errors import (
    BatchTooLargeError,
    ConflictError,
    InvalidRequestError,
    ReservationClosedError,
    StoreFullError,
    UnknownNamespaceError,
    UnknownReservationError,
)
from kvstore.policies import make_policy

# A policy that loops over ineligible entries must fail the test, not hang the run.
pytestmark = pytest.mark.timeout(120)

KiB = 1024
MiB = 1024 * KiB
DO = 2 * MiB  # data offset of every arena below 512 GiB
NS = "m@1/default"
NO_WATERMARKS = {"high_watermark": 1.0, "low_watermark": 1.0}


@dataclass
class Rig:
    engine: Engine
    alloc: SlabAllocator
    gens: np.ndarray
    layout: ArenaLayout

    def gen_at(self, offset: int) -> int:
        return int(self.gens[self.layout.generation_index(offset)])


def make_rig(
    data_bytes: int = 4 * MiB, max_block: int = 1 * MiB, policy: str = "lru", **cfg: float | int
) -> Rig:
    layout = ArenaLayout.for_capacity("x", data_bytes, max_block)
    gens = np.zeros(layout.gen_table_bytes // 8, dtype=np.uint64)
    alloc = SlabAllocator(layout.data_offset, layout.data_bytes, max_block)
    engine = Engine(EngineConfig(max_block_bytes=max_block, **cfg), layout, gens, alloc, make_policy(policy))
    assert engine.register_namespace(NS) is True
    return Rig(engine, alloc, gens, layout)


def put(eng: Engine, keys: list[bytes], size: int = 1 * MiB, ns: str = NS) -> list[int]:
    """Reserve and commit `keys` (all new); the offsets they got."""
    r = eng.reserve(ns, keys, [size] * len(keys))
    assert r.outcomes == [RESERVED] * len(keys)
    assert eng.commit(r.reservation_id) == len(keys)
    return r.offsets


def touch(eng: Engine, *keys: bytes) -> None:
    """An access without a lease (refreshes recency only)."""
    assert eng.lookup(NS, list(keys), lease=False).present == [True] * len(keys)


def present(eng: Engine, keys: list[bytes]) -> list[bool]:
    return eng.exists(NS, keys)


def later(seconds: float) -> float:
    """A monotonic time `seconds` from now (what sweep compares deadlines with)."""
    return time.monotonic() + seconds


# ----------------------------------------------------------------------------------------- namespaces


def test_register_namespace_idempotent_and_conflicting() -> None:
    eng = make_rig().engine
    assert eng.register_namespace("b", model="llama", layout_digest="3f2a", tenant="t") is True
    assert eng.register_namespace("b", model="llama", layout_digest="3f2a", tenant="t") is False
    with pytest.raises(ConflictError, match="different namespace name"):
        eng.register_namespace("b", model="llama", layout_digest="ffff", tenant="t")
    with pytest.raises(ConflictError):
        eng.register_namespace(NS, model="other")
    for bad in ("", "has space", "x" * 201, "ünï"):
        with pytest.raises(InvalidRequestError, match="invalid namespace"):
            eng.register_namespace(bad)
    assert [n.name for n in eng.stats().namespaces] == [NS, "b"]


def test_unknown_and_malformed_namespace_in_every_call() -> None:
    eng = make_rig().engine
    calls = [
        lambda ns: eng.reserve(ns, [b"k"], [1]),
        lambda ns: eng.lookup(ns, [b"k"]),
        lambda ns: eng.exists(ns, [b"k"]),
        lambda ns: eng.delete(ns, [b"k"]),
        lambda ns: eng.pin(ns, [b"k"], 1),
        lambda ns: eng.list_keys(ns, b"", 10),
        lambda ns: eng.clear_namespace(ns),
    ]
    for call in calls:
        with pytest.raises(UnknownNamespaceError, match="register it first"):
            call("never-registered")
        # a malformed name is a bad request, not an unknown namespace
        with pytest.raises(InvalidRequestError, match="invalid namespace"):
            call("bad name")


# ----------------------------------------------------------------------------------------- reserve / commit / lookup


def test_reserve_commit_lookup_exact_values() -> None:
    rig = make_rig()
    eng = rig.engine
    # reserve k1 (1 MiB), k2 (4 KiB), k3 (6000 B -> 8 KiB class): one slab each, lowest first
    r = eng.reserve(NS, [b"k1", b"k2", b"k3"], [1 * MiB, 4 * KiB, 6000])
    assert r.outcomes == [RESERVED] * 3
    assert r.offsets == [DO, DO + 1 * MiB, DO + 2 * MiB]
    assert r.reservation_id != 0 and r.expires_in_ms == 30_000
    # reserved blocks are invisible and their keys are IN_FLIGHT for a second writer (no slot, no id)
    assert present(eng, [b"k1", b"k2", b"k3"]) == [False] * 3
    assert eng.lookup(NS, [b"k1"]).present == [False]
    r2 = eng.reserve(NS, [b"k1", b"k2", b"k3"], [1 * MiB, 4 * KiB, 6000])
    assert (r2.reservation_id, r2.outcomes, r2.offsets, r2.expires_in_ms) == (0, [IN_FLIGHT] * 3, [0, 0, 0], 0)
    # commit with checksums -> lookup returns exactly what was reserved, generation 0, leased
    assert eng.commit(r.reservation_id, [11, 22, 33]) == 3
    res = eng.lookup(NS, [b"k1", b"k2", b"k3"])
    assert res.num_prefix == 3 and res.present == [True] * 3
    assert res.offsets == [DO, DO + 1 * MiB, DO + 2 * MiB]
    assert res.sizes == [1 * MiB, 4 * KiB, 6000]
    assert res.generations == [0, 0, 0]
    assert res.checksums == [11, 22, 33]
    assert res.lease_id != 0 and res.expires_in_ms == 30_000
    # now ALREADY_PRESENT; a mixed batch reserves only the new key (k4 fills slot 1 of k2's 4 KiB slab)
    r3 = eng.reserve(NS, [b"k1", b"k4", b"k3"], [1 * MiB, 4 * KiB, 6000])
    assert r3.outcomes == [ALREADY_PRESENT, RESERVED, ALREADY_PRESENT]
    assert r3.offsets == [0, DO + 1 * MiB + 4 * KiB, 0]
    assert eng.commit(r3.reservation_id) == 1
    assert eng.lookup(NS, [b"k4"], lease=False).checksums == [0]  # committed without checksums
    c = eng.stats().counters
    assert (c["reserve_calls"], c["reserved_blocks"], c["committed_blocks"]) == (3, 4, 4)
    assert c["committed_bytes"] == 1 * MiB + 4 * KiB + 6000 + 4 * KiB


def test_lookup_without_lease() -> None:
    eng = make_rig().engine
    put(eng, [b"k1"])
    res = eng.lookup(NS, [b"k1"], lease=False)
    assert (res.lease_id, res.expires_in_ms, res.offsets) == (0, 0, [DO])
    assert eng.stats().leases_active == 0
    # a total miss returns empty columns and no lease
    miss = eng.lookup(NS, [b"nope", b"nada"])
    assert (miss.num_prefix, miss.present, miss.offsets, miss.lease_id) == (0, [False, False], [], 0)


def test_prefix_lookup_stops_at_first_miss_and_counts_hits() -> None:
    rig = make_rig(data_bytes=4 * MiB, max_block=64 * KiB)
    eng = rig.engine
    put(eng, [b"a", b"b", b"d"], size=64 * KiB)
    # prefix over a, b, c(miss), d -> stops at c: present has 3 entries, 2 hits, d never examined
    res = eng.lookup(NS, [b"a", b"b", b"c", b"d"], prefix=True, lease=False)
    assert (res.num_prefix, res.present) == (2, [True, True, False])
    assert res.offsets == [DO, DO + 64 * KiB]
    # the same keys without prefix: every key answered, 3 hits, prefix length still 2
    full = eng.lookup(NS, [b"a", b"b", b"c", b"d"], lease=False)
    assert (full.num_prefix, full.present) == (2, [True, True, False, True])
    assert full.offsets == [DO, DO + 64 * KiB, DO + 128 * KiB]
    # prefix with first key missing -> nothing
    none = eng.lookup(NS, [b"c", b"a"], prefix=True)
    assert (none.num_prefix, none.present, none.lease_id) == (0, [False], 0)
    st = eng.stats()
    assert (st.counters["lookup_calls"], st.counters["lookup_keys"], st.counters["hit_keys"]) == (3, 10, 5)
    [ns] = st.namespaces
    assert (ns.lookup_keys, ns.hit_keys) == (10, 5)


def test_prefix_lookup_leases_only_the_prefix() -> None:
    eng = make_rig(max_block=64 * KiB).engine
    put(eng, [b"a", b"c"], size=64 * KiB)
    res = eng.lookup(NS, [b"a", b"b", b"c"], prefix=True)
    assert res.num_prefix == 1
    records = {r.key: r.leases for r in eng.list_keys(NS, b"", 10)[0]}
    assert records == {b"a": 1, b"c": 0}


def test_double_commit_abort_and_unknown_reservation() -> None:
    eng = make_rig().engine
    r = eng.reserve(NS, [b"k1"], [1 * MiB])
    assert eng.commit(r.reservation_id) == 1
    with pytest.raises(ReservationClosedError, match="already committed"):
        eng.commit(r.reservation_id)
    with pytest.raises(ReservationClosedError, match="already committed"):
        eng.abort(r.reservation_id)
    r2 = eng.reserve(NS, [b"k2"], [1 * MiB])
    assert eng.abort(r2.reservation_id) == 1
    with pytest.raises(ReservationClosedError, match="already aborted"):
        eng.commit(r2.reservation_id)
    for call in (eng.commit, eng.abort):
        with pytest.raises(UnknownReservationError, match="unknown to this daemon"):
            call(r.reservation_id + 1000)
        with pytest.raises(UnknownReservationError):
            call(0)


def test_commit_with_wrong_checksum_count_keeps_reservation_open() -> None:
    rig = make_rig()
    eng = rig.engine
    r = eng.reserve(NS, [b"k1", b"k2"], [1 * MiB, 1 * MiB])
    for bad in ([1], [1, 2, 3]):
        with pytest.raises(InvalidRequestError, match="send none or one each"):
            eng.commit(r.reservation_id, bad)
    assert eng.stats().reservations_active == 1 and present(eng, [b"k1", b"k2"]) == [False, False]
    assert eng.commit(r.reservation_id, [7, 8]) == 2
    assert eng.lookup(NS, [b"k1", b"k2"], lease=False).checksums == [7, 8]


def test_abort_frees_slots_and_bumps_generation() -> None:
    rig = make_rig()
    eng = rig.engine
    r = eng.reserve(NS, [b"k1", b"k2"], [1 * MiB, 1 * MiB])
    assert rig.alloc.allocated_bytes == 2 * MiB
    assert eng.abort(r.reservation_id) == 2
    assert rig.alloc.allocated_bytes == 0
    assert (rig.gen_at(DO), rig.gen_at(DO + 1 * MiB)) == (1, 1)
    assert eng.stats().counters["aborted_blocks"] == 2
    # the keys are free to reserve again
    assert eng.reserve(NS, [b"k1"], [1 * MiB]).outcomes == [RESERVED]


# ----------------------------------------------------------------------------------------- store full / eviction


def test_store_full_is_all_or_nothing() -> None:
    rig = make_rig()
    eng = rig.engine
    # commit k1..k3 (1 MiB each) and lease them all -> one free slab, nothing evictable
    put(eng, [b"k1", b"k2", b"k3"])
    lease = eng.lookup(NS, [b"k1", b"k2", b"k3"]).lease_id
    # reserve n1, n2 -> n1 would fit in slab 3, n2 cannot: StoreFullError, and n1's slot is given back
    with pytest.raises(StoreFullError, match="store full"):
        eng.reserve(NS, [b"n1", b"n2"], [1 * MiB, 1 * MiB])
    assert rig.alloc.allocated_bytes == 3 * MiB and rig.alloc.free_slabs == 1
    st = eng.stats()
    assert (st.reservations_active, st.reserved_bytes, st.blocks) == (0, 0, 3)
    assert st.counters["store_full"] == 1 and st.counters["evictions"] == 0
    assert eng.reserve(NS, [b"n1"], [1 * MiB]).outcomes == [RESERVED]  # the key was not left IN_FLIGHT
    assert rig.gen_at(DO + 3 * MiB) == 0  # never visible, so no generation bump
    # release the lease -> the same two-key batch now evicts k1 (LRU) for n2
    eng.release([lease])
    r = eng.reserve(NS, [b"n2"], [1 * MiB])
    assert r.offsets == [DO]
    assert present(eng, [b"k1", b"k2", b"k3"]) == [False, True, True]


def test_eviction_follows_lru_and_skips_leased_and_pinned() -> None:
    rig = make_rig(**NO_WATERMARKS)
    eng = rig.engine
    # put k1..k4 (1 MiB each) -> arena full; slabs 0..3 in key order
    assert put(eng, [b"k1", b"k2", b"k3", b"k4"]) == [DO, DO + 1 * MiB, DO + 2 * MiB, DO + 3 * MiB]
    # lease k1, then touch k2, k3, k4 -> LRU order k1, k2, k3, k4 with k1 leased
    lease = eng.lookup(NS, [b"k1"]).lease_id
    touch(eng, b"k2", b"k3", b"k4")
    # put k5 -> evicts k2 (LRU, k1 leased); k5 takes k2's slab
    assert put(eng, [b"k5"]) == [DO + 1 * MiB]
    assert present(eng, [b"k1", b"k2", b"k3", b"k4", b"k5"]) == [True, False, True, True, True]
    # pin k3; put k6 -> evicts k4 (k1 leased, k3 pinned)
    assert eng.pin(NS, [b"k3"], +1) == 1
    assert put(eng, [b"k6"]) == [DO + 3 * MiB]
    assert present(eng, [b"k1", b"k3", b"k4", b"k5", b"k6"]) == [True, True, False, True, True]
    # release k1 -> it kept its LRU position while leased: put k7 evicts k1 (not k5)
    assert eng.release([lease]) == 1
    assert put(eng, [b"k7"]) == [DO]
    assert present(eng, [b"k1", b"k3", b"k5", b"k6", b"k7"]) == [False, True, True, True, True]
    # unpin k3 -> put k8 evicts k3, then put k9 evicts k5
    assert eng.pin(NS, [b"k3"], -1) == 1
    assert put(eng, [b"k8"]) == [DO + 2 * MiB]
    assert put(eng, [b"k9"]) == [DO + 1 * MiB]
    assert present(eng, [b"k5", b"k6", b"k7", b"k8", b"k9"]) == [False, True, True, True, True]
    # every evicted slot's generation went up by one; the new occupant sees it
    assert eng.lookup(NS, [b"k7", b"k9", b"k8", b"k6"], lease=False).generations == [1, 2, 1, 1]
    c = eng.stats().counters
    assert (c["evictions"], c["evicted_bytes"]) == (5, 5 * MiB)


def test_lookup_refreshes_lru_order() -> None:
    eng = make_rig(**NO_WATERMARKS).engine
    put(eng, [b"k1", b"k2", b"k3", b"k4"])
    # touch k1 -> order k2, k3, k4, k1: put k5 evicts k2
    touch(eng, b"k1")
    put(eng, [b"k5"])
    assert present(eng, [b"k1", b"k2"]) == [True, False]
    # touch k3 then k1 -> order k4, k5, k3, k1: put k6 evicts k4, put k7 evicts k5
    touch(eng, b"k3")
    touch(eng, b"k1")
    put(eng, [b"k6"])
    assert present(eng, [b"k4"]) == [False]
    put(eng, [b"k7"])
    assert present(eng, [b"k1", b"k3", b"k5", b"k6", b"k7"]) == [True, True, False, True, True]
    # a leased lookup refreshes too: lookup k3 (leased) -> order k1, k6, k7, k3 -> put k8 evicts k1
    eng.release([eng.lookup(NS, [b"k3"]).lease_id])
    put(eng, [b"k8"])
    assert present(eng, [b"k1", b"k3", b"k6"]) == [False, True, True]


def test_reserve_never_evicts_keys_it_reports_already_present() -> None:
    eng = make_rig(**NO_WATERMARKS).engine
    put(eng, [b"k1", b"k2", b"k3", b"k4"])
    # reserve [k1, k5] with k1 the LRU entry -> k1 is ALREADY_PRESENT, so k2 is evicted instead
    r = eng.reserve(NS, [b"k1", b"k5"], [1 * MiB, 1 * MiB])
    assert r.outcomes == [ALREADY_PRESENT, RESERVED]
    assert r.offsets == [0, DO + 1 * MiB]
    assert present(eng, [b"k1", b"k2"]) == [True, False]
    # when the only evictable entry is in the batch, the reserve is full instead of lying
    eng.commit(r.reservation_id)
    lease = eng.lookup(NS, [b"k3", b"k4", b"k5"]).lease_id
    with pytest.raises(StoreFullError):
        eng.reserve(NS, [b"k1", b"k6"], [1 * MiB, 1 * MiB])
    assert present(eng, [b"k1"]) == [True]
    eng.release([lease])


def test_reserved_and_in_flight_blocks_are_never_evicted() -> None:
    rig = make_rig(**NO_WATERMARKS)
    eng = rig.engine
    # reserve k1..k4 without committing -> nothing is evictable
    r = eng.reserve(NS, [b"k1", b"k2", b"k3", b"k4"], [1 * MiB] * 4)
    with pytest.raises(StoreFullError):
        eng.reserve(NS, [b"k5"], [1 * MiB])
    eng.commit(r.reservation_id)
    # committed -> k1 (oldest) goes for k5
    assert eng.reserve(NS, [b"k5"], [1 * MiB]).offsets == [DO]


def test_watermark_eviction_after_commit() -> None:
    # 64 slabs of 64 KiB, 64 KiB blocks: high 0.95 -> > 60.8 blocks triggers, low 0.90 -> down to 57 blocks
    rig = make_rig(data_bytes=4 * MiB, max_block=64 * KiB)
    eng = rig.engine
    keys = [b"k%02d" % i for i in range(64)]
    put(eng, keys[:60], size=64 * KiB)
    assert eng.stats().blocks == 60  # 93.75 %: under the high watermark, nothing evicted
    # put k60 -> 61 blocks = 95.3 % > 95 %: evict in LRU order k00..k03 until 57 * 64 KiB <= 90 %
    put(eng, [keys[60]], size=64 * KiB)
    st = eng.stats()
    assert (st.blocks, st.allocated_bytes) == (57, 57 * 64 * KiB)
    assert st.counters["evictions"] == 4
    assert present(eng, keys[:5]) == [False] * 4 + [True]
    # pinned and leased blocks are skipped by the watermark too: pin k04, lease k05, then fill past 95 %
    eng.pin(NS, [keys[4]], 1)
    lease = eng.lookup(NS, [keys[5]]).lease_id
    put(eng, keys[61:64] + [b"x1"], size=64 * KiB)  # 61 blocks again -> evict 4: k06..k09
    assert present(eng, keys[4:11]) == [True, True, False, False, False, False, True]
    assert eng.stats().blocks == 57
    eng.release([lease])


def test_watermark_eviction_stops_when_nothing_is_evictable() -> None:
    rig = make_rig(data_bytes=4 * MiB, max_block=64 * KiB)
    eng = rig.engine
    keys = [b"k%02d" % i for i in range(62)]
    # 62 blocks in one batch, all leased before the next commit -> that commit cannot evict anything
    put(eng, keys[:58], size=64 * KiB)
    lease = eng.lookup(NS, keys[:58]).lease_id
    put(eng, keys[58:62], size=64 * KiB)  # 62 blocks = 96.9 %: evicts the 4 unleased ones, then stops
    st = eng.stats()
    assert st.blocks == 58 and st.counters["evictions"] == 4
    assert present(eng, keys[58:62]) == [False] * 4
    eng.release([lease])


# ----------------------------------------------------------------------------------------- time: leases, reservations


def test_release_and_lease_expiry() -> None:
    eng = make_rig(**NO_WATERMARKS).engine
    put(eng, [b"k1", b"k2", b"k3", b"k4"])
    l1 = eng.lookup(NS, [b"k1"]).lease_id
    l2 = eng.lookup(NS, [b"k2", b"k1"]).lease_id  # k1 now holds 2 leases
    assert l1 != l2 and eng.stats().leases_active == 2
    assert eng.release([l1, l1, 123456789]) == 1  # second release of l1 and an unknown id are no-ops
    assert {r.key: r.leases for r in eng.list_keys(NS, b"", 10)[0]} == {b"k1": 1, b"k2": 1, b"k3": 0, b"k4": 0}
    # a sweep before the TTL changes nothing
    eng.sweep(now=time.monotonic())
    assert eng.stats().leases_active == 1
    # sweep past the lease TTL -> l2 dropped: k1, k2 unleased and evictable (k1, k2 are the LRU)
    eng.sweep(now=later(eng.config.lease_ttl_s + 1))
    st = eng.stats()
    assert (st.leases_active, st.leased_bytes, st.counters["lease_expirations"]) == (0, 0, 1)
    assert eng.release([l2]) == 0  # too late: already expired
    touch(eng, b"k3", b"k4")
    put(eng, [b"k5"])
    assert present(eng, [b"k1", b"k2"]) == [True, False]  # k2 was least recent (touched after k1 by l2)


def test_reservation_expiry_quarantines_then_frees() -> None:
    rig = make_rig(quarantine_s=10.0)
    eng = rig.engine
    r = eng.reserve(NS, [b"k1"], [1 * MiB])
    assert r.offsets == [DO]
    # sweep past the reservation TTL -> expired: invisible, slot quarantined (still allocated), key free
    t = later(eng.config.reservation_ttl_s + 1)
    eng.sweep(now=t)
    with pytest.raises(ReservationClosedError, match="expired"):
        eng.commit(r.reservation_id)
    with pytest.raises(ReservationClosedError, match="already expired"):
        eng.abort(r.reservation_id)
    st = eng.stats()
    assert (st.allocated_bytes, st.reservations_active, st.reserved_bytes, st.blocks) == (1 * MiB, 0, 0, 0)
    assert st.counters["reservation_expirations"] == 1
    assert present(eng, [b"k1"]) == [False]
    # the key can be reserved again; it gets another slot, never the quarantined one
    r2 = eng.reserve(NS, [b"k1"], [1 * MiB])
    assert r2.outcomes == [RESERVED] and r2.offsets == [DO + 1 * MiB]
    eng.abort(r2.reservation_id)
    # before the quarantine deadline (t + 10 s) the slot stays allocated
    eng.sweep(now=t + 9.0)
    assert rig.alloc.allocated_bytes == 1 * MiB and rig.gen_at(DO) == 0
    # past it -> freed, generation bumped, and slab 0 is handed out again
    eng.sweep(now=t + 10.5)
    assert rig.alloc.allocated_bytes == 0 and rig.gen_at(DO) == 1
    assert eng.stats().counters["quarantine_freed"] == 1
    # the free-slab pool is a stack: slab 0 (freed last) is handed out before slab 1 (freed by the abort)
    assert eng.reserve(NS, [b"k2"], [1 * MiB]).offsets == [DO]
    assert eng.reserve(NS, [b"k3"], [1 * MiB]).offsets == [DO + 1 * MiB]


def test_generation_bumps_on_every_free_and_lookup_reports_current() -> None:
    # 2 slabs of 1 MiB: every block below lands in slab 0 (generation index 0)
    rig = make_rig(data_bytes=2 * MiB, **NO_WATERMARKS)
    eng = rig.engine
    put(eng, [b"a"])
    assert eng.lookup(NS, [b"a"], lease=False).generations == [0]
    # delete -> 1
    eng.delete(NS, [b"a"])
    assert rig.gen_at(DO) == 1
    # reserve, abort -> 2
    r = eng.reserve(NS, [b"b"], [1 * MiB])
    assert r.offsets == [DO]
    eng.abort(r.reservation_id)
    assert rig.gen_at(DO) == 2
    # reserve, expire, quarantine release -> 3
    r = eng.reserve(NS, [b"c"], [1 * MiB])
    assert r.offsets == [DO]
    t = later(eng.config.reservation_ttl_s + 1)
    eng.sweep(now=t)
    assert rig.gen_at(DO) == 2  # quarantined, not yet freed
    eng.sweep(now=t + eng.config.quarantine_s + 1)
    assert rig.gen_at(DO) == 3
    # commit d into it -> lookup reports 3; put e into slab 1, then f evicts d -> 4, f sees 4
    assert put(eng, [b"d"]) == [DO]
    assert eng.lookup(NS, [b"d"], lease=False).generations == [3]
    assert put(eng, [b"e"]) == [DO + 1 * MiB]
    assert put(eng, [b"f"]) == [DO]
    assert eng.lookup(NS, [b"f", b"e"], lease=False).generations == [4, 0]


# ----------------------------------------------------------------------------------------- delete / pin / clear / list


def test_delete_of_leased_block_hides_it_and_frees_on_last_release() -> None:
    rig = make_rig()
    eng = rig.engine
    put(eng, [b"k1", b"k2"])
    l1 = eng.lookup(NS, [b"k1"]).lease_id
    l2 = eng.lookup(NS, [b"k1"]).lease_id
    # delete k1 (leased twice) -> gone for readers at once, slot still allocated
    assert eng.delete(NS, [b"k1", b"missing"]) == 1
    assert present(eng, [b"k1"]) == [False]
    assert eng.lookup(NS, [b"k1"]).present == [False]
    st = eng.stats()
    assert (st.blocks, st.stored_bytes, st.allocated_bytes, st.leased_bytes) == (1, 1 * MiB, 2 * MiB, 1 * MiB)
    assert st.counters["deleted_blocks"] == 1
    assert eng.delete(NS, [b"k1"]) == 0  # already deleted
    # a new writer may reserve k1 meanwhile; it gets another slot
    r = eng.reserve(NS, [b"k1"], [1 * MiB])
    assert r.offsets == [DO + 2 * MiB]
    eng.abort(r.reservation_id)
    # first release -> still held; last release -> freed, generation bumped
    eng.release([l1])
    assert rig.alloc.allocated_bytes == 2 * MiB and rig.gen_at(DO) == 0
    eng.release([l2])
    assert rig.alloc.allocated_bytes == 1 * MiB and rig.gen_at(DO) == 1


def test_delete_of_leased_block_frees_on_lease_expiry() -> None:
    rig = make_rig()
    eng = rig.engine
    put(eng, [b"k1"])
    eng.lookup(NS, [b"k1"])
    eng.delete(NS, [b"k1"])
    assert rig.alloc.allocated_bytes == 1 * MiB
    eng.sweep(now=later(eng.config.lease_ttl_s + 1))
    assert rig.alloc.allocated_bytes == 0 and rig.gen_at(DO) == 1


def test_delete_and_pin_ignore_reserved_blocks() -> None:
    eng = make_rig().engine
    r = eng.reserve(NS, [b"k1"], [1 * MiB])
    assert eng.delete(NS, [b"k1"]) == 0
    assert eng.pin(NS, [b"k1"], 1) == 0
    assert eng.commit(r.reservation_id) == 1
    assert present(eng, [b"k1"]) == [True]


def test_pin_nesting_and_unpin_below_zero() -> None:
    eng = make_rig(**NO_WATERMARKS).engine
    put(eng, [b"k1", b"k2", b"k3", b"k4"])
    # pin k1 twice, unpin once -> still pinned: put k5 evicts k2, not k1
    assert eng.pin(NS, [b"k1", b"missing"], +1) == 1
    assert eng.pin(NS, [b"k1"], +1) == 1
    assert eng.pin(NS, [b"k1"], -1) == 1
    assert eng.list_keys(NS, b"", 1)[0][0].pins == 1
    put(eng, [b"k5"])
    assert present(eng, [b"k1", b"k2"]) == [True, False]
    # unpin to 0; a further unpin changes nothing (no negative pins)
    assert eng.pin(NS, [b"k1"], -1) == 1
    assert eng.pin(NS, [b"k1"], -1) == 0
    assert eng.list_keys(NS, b"", 1)[0][0].pins == 0
    # k1 is evictable again (and LRU): put k6 evicts it
    put(eng, [b"k6"])
    assert present(eng, [b"k1"]) == [False]
    assert eng.stats().pinned_bytes == 0


def test_clear_namespace() -> None:
    rig = make_rig(max_block=64 * KiB)
    eng = rig.engine
    eng.register_namespace("other")
    put(eng, [b"a", b"b", b"c"], size=64 * KiB)
    put(eng, [b"a", b"z"], size=64 * KiB, ns="other")
    lease = eng.lookup(NS, [b"b"]).lease_id
    pending = eng.reserve(NS, [b"d"], [64 * KiB])
    # clear NS -> 3 committed blocks deleted (b hidden but held by its lease); d still in flight; other intact
    assert eng.clear_namespace(NS) == 3
    assert present(eng, [b"a", b"b", b"c"]) == [False] * 3
    assert eng.exists("other", [b"a", b"z"]) == [True, True]
    assert rig.alloc.allocated_bytes == 4 * 64 * KiB  # other's 2 + lease-held b + reserved d
    eng.release([lease])
    assert rig.alloc.allocated_bytes == 3 * 64 * KiB
    assert eng.commit(pending.reservation_id) == 1
    assert present(eng, [b"d"]) == [True]
    assert eng.clear_namespace("other") == 2
    assert eng.clear_namespace("other") == 0


def test_list_keys_pagination() -> None:
    eng = make_rig(data_bytes=4 * MiB, max_block=64 * KiB).engine
    keys = [b"k%02d" % i for i in range(10)]
    shuffled = keys[:]
    random.Random(7).shuffle(shuffled)
    put(eng, shuffled, size=4 * KiB)
    eng.reserve(NS, [b"k05x"], [4 * KiB])  # in flight: never listed
    page1, cur1 = eng.list_keys(NS, b"", 4)
    page2, cur2 = eng.list_keys(NS, cur1, 4)
    page3, cur3 = eng.list_keys(NS, cur2, 4)
    assert [r.key for r in page1] == keys[0:4] and cur1 == b"k03"
    assert [r.key for r in page2] == keys[4:8] and cur2 == b"k07"
    assert [r.key for r in page3] == keys[8:10] and cur3 == b""
    # an exact last page also ends with an empty cursor
    assert ([r.key for r in eng.list_keys(NS, b"k05", 4)[0]], eng.list_keys(NS, b"k05", 4)[1]) == (keys[6:], b"")
    rec = page1[0]
    assert (rec.size, rec.tier, rec.pins, rec.leases, rec.checksum) == (4 * KiB, "ram", 0, 0, 0)
    assert 0.0 <= rec.age_s < 60.0
    for bad in (0, -1, 10_001):
        with pytest.raises(InvalidRequestError, match="limit"):
            eng.list_keys(NS, b"", bad)
    assert eng.list_keys(NS, b"zzz", 10) == ([], b"")


# ----------------------------------------------------------------------------------------- stats


def test_stats_exact_fields() -> None:
    rig = make_rig(max_block=64 * KiB)
    eng = rig.engine
    # a (64 KiB), b (20000 B -> 20 KiB slot), c (4 KiB) committed; d (5000 B -> 8 KiB slot) reserved
    put(eng, [b"a"], size=64 * KiB)
    put(eng, [b"b"], size=20000)
    put(eng, [b"c"], size=4 * KiB)
    eng.reserve(NS, [b"d"], [5000])
    eng.pin(NS, [b"a", b"c"], 1)
    lease = eng.lookup(NS, [b"b", b"c"]).lease_id
    eng.lookup(NS, [b"nope"], lease=False)
    st = eng.stats()
    assert (st.policy, st.capacity_bytes, st.slab_bytes, st.slabs_total, st.slabs_free) == (
        "lru", 4 * MiB, 64 * KiB, 64, 60)
    assert st.allocated_bytes == 64 * KiB + 20 * KiB + 4 * KiB + 8 * KiB
    assert st.stored_bytes == 64 * KiB + 20000 + 4 * KiB
    assert st.reserved_bytes == 8 * KiB  # slot bytes of reserved blocks
    assert st.leased_bytes == 20000 + 4 * KiB
    assert st.pinned_bytes == 64 * KiB + 4 * KiB
    # fragmentation: the share of allocated slot bytes not holding stored bytes; stranded: assigned slabs' free
    # slots (4 slabs of 64 KiB minus the 96 KiB of slots in use)
    assert st.fragmentation == pytest.approx(1 - (64 * KiB + 20000 + 4 * KiB) / (96 * KiB))
    assert st.stranded_bytes == 4 * 64 * KiB - 96 * KiB
    assert (st.blocks, st.leases_active, st.reservations_active) == (3, 1, 1)
    assert (st.high_watermark, st.low_watermark) == (0.95, 0.90)
    assert st.namespaces == [NamespaceUsage(NS, "", "", "", 3, 64 * KiB + 20000 + 4 * KiB, 3, 2, 3)]
    assert st.size_classes == [
        ClassUsage(4 * KiB, 1, 1, 15), ClassUsage(8 * KiB, 1, 1, 7),
        ClassUsage(20 * KiB, 1, 1, 2), ClassUsage(64 * KiB, 1, 1, 0),
    ]
    assert st.counters == {
        "reserve_calls": 4, "reserved_blocks": 4, "committed_blocks": 3,
        "committed_bytes": 64 * KiB + 20000 + 4 * KiB, "aborted_blocks": 0, "lookup_calls": 2,
        "lookup_keys": 3, "hit_keys": 2, "evictions": 0, "evicted_bytes": 0, "deleted_blocks": 0,
        "lease_expirations": 0, "reservation_expirations": 0, "quarantine_freed": 0, "store_full": 0,
        "checksum_failures": 0, "hit_keys_ram": 2, "hit_keys_disk": 0, "hit_keys_peer": 0, "promotions": 0,
        "promotion_failures": 0,
        "disk_writes": 0, "disk_write_failures": 0, "demote_dropped": 0, "demote_queue_full": 0,
        "evicted_to_disk": 0, "hit_bytes_ram": 20000 + 4 * KiB, "hit_bytes_disk": 0, "disk_reinserted": 0,
        "slab_binds": 0, "slab_bind_failures": 0,
    }
    eng.release([lease])
    assert eng.stats().leased_bytes == 0


def test_stats_of_empty_engine() -> None:
    st = make_rig().engine.stats()
    assert (st.allocated_bytes, st.stored_bytes, st.reserved_bytes, st.blocks, st.fragmentation) == (0, 0, 0, 0, 0.0)
    assert st.size_classes == [] and st.slabs_free == 4


# ----------------------------------------------------------------------------------------- validation


def test_validation_errors() -> None:
    eng = make_rig(max_batch_keys=4).engine
    put(eng, [b"k"])
    key_calls = {
        "reserve": lambda ks: eng.reserve(NS, ks, [1] * len(ks)),
        "lookup": lambda ks: eng.lookup(NS, ks),
        "exists": lambda ks: eng.exists(NS, ks),
        "delete": lambda ks: eng.delete(NS, ks),
        "pin": lambda ks: eng.pin(NS, ks, 1),
    }
    for call in key_calls.values():
        with pytest.raises(InvalidRequestError, match="empty key batch"):
            call([])
        with pytest.raises(BatchTooLargeError, match="max_batch_keys=4"):
            call([b"a", b"b", b"c", b"d", b"e"])
        with pytest.raises(InvalidRequestError, match="65 bytes"):
            call([b"x" * 65])
        with pytest.raises(InvalidRequestError, match="0 bytes"):
            call([b""])
        with pytest.raises(InvalidRequestError, match="expected bytes"):
            call(["text"])
    # 64-byte keys and a full batch of 4 are fine
    assert eng.exists(NS, [b"x" * 64, b"b", b"c", b"d"]) == [False] * 4
    with pytest.raises(InvalidRequestError, match="size 0 of key 0"):
        eng.reserve(NS, [b"a"], [0])
    with pytest.raises(InvalidRequestError, match="out of range"):
        eng.reserve(NS, [b"a"], [1 * MiB + 1])
    with pytest.raises(InvalidRequestError, match="one size per key"):
        eng.reserve(NS, [b"a", b"b"], [1])
    with pytest.raises(InvalidRequestError, match="duplicate keys"):
        eng.reserve(NS, [b"a", b"a"], [1, 1])
    # reads may repeat a key
    assert eng.lookup(NS, [b"k", b"k"], lease=False).present == [True, True]
    # nothing was reserved by any rejected call
    st = eng.stats()
    assert (st.reservations_active, st.allocated_bytes, st.counters["reserve_calls"]) == (0, 1 * MiB, 1)


def test_duplicate_keys_in_one_lookup_lease_twice() -> None:
    rig = make_rig()
    eng = rig.engine
    put(eng, [b"k"])
    lease = eng.lookup(NS, [b"k", b"k"]).lease_id
    assert eng.list_keys(NS, b"", 1)[0][0].leases == 2
    eng.delete(NS, [b"k"])
    eng.release([lease])
    assert rig.alloc.allocated_bytes == 0 and rig.gen_at(DO) == 1  # freed once


# ----------------------------------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_policy_smoke_inside_engine(policy: str) -> None:
    rig = make_rig(data_bytes=4 * MiB, max_block=64 * KiB, policy=policy)
    eng = rig.engine
    assert eng.stats().policy == policy
    # 64 slots of 64 KiB; keep h0..h3 hot (accessed) and h0 leased, stream 200 cold blocks through
    put(eng, [b"h0", b"h1", b"h2", b"h3"], size=64 * KiB)
    lease = eng.lookup(NS, [b"h0"]).lease_id
    for i in range(200):
        put(eng, [b"c%03d" % i], size=64 * KiB)
        touch(eng, b"h1", b"h2", b"h3")
        st = eng.stats()
        assert st.allocated_bytes <= 0.95 * st.capacity_bytes
        assert st.allocated_bytes == st.blocks * 64 * KiB
    assert present(eng, [b"h0", b"h1", b"h2", b"h3"]) == [True] * 4
    st = eng.stats()
    assert st.counters["evictions"] == 204 - st.blocks
    # every present key's slot is distinct and lookups agree with exists
    keys = [b"c%03d" % i for i in range(200)]
    hits = [k for k, p in zip(keys, present(eng, keys)) if p]
    offsets = eng.lookup(NS, hits, lease=False).offsets
    assert len(set(offsets)) == len(hits) == st.blocks - 4
    eng.release([lease])


# ----------------------------------------------------------------------------------------- memory


def test_memory_per_committed_entry_under_256_bytes() -> None:
    n, batch = 200_000, 256
    rig = make_rig(data_bytes=1024 * MiB, max_block=1 * MiB)  # 200k x 4 KiB = 78 % of the arena: no eviction
    eng = rig.engine
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # keys are created in the traced region: the engine keeps them, so they are part of the cost
        for start in range(0, n, batch):
            keys = [b"block-%016x" % i for i in range(start, min(start + batch, n))]
            r = eng.reserve(NS, keys, [4 * KiB] * len(keys))
            eng.commit(r.reservation_id)
        del keys, r
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    per_entry = (after - before) / n
    print(f"\nengine heap per committed 4 KiB entry: {per_entry:.1f} bytes")
    assert eng.stats().blocks == n
    assert per_entry < 256, per_entry
