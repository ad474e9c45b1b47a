"""The RAM-tier engine over time and removal: lease release and expiry, reservation expiry and quarantine,
generations bumped on every free, delete of leased blocks, pins, clear and list. Times are explicit:
`sweep(now=later(...))` gets a monotonic time past the TTL instead of sleeping. Every check is an exact value.

Default rig (tests/engine_helpers.py): 4 MiB of data in 1 MiB slabs (4 slabs; max_block_bytes = slab), data at
DO = 2 MiB, so slab i starts at DO + i MiB and its generation sits at index i * 256 of the table.
"""

from __future__ import annotations

import random
import time

import pytest

from kvstore.engine.results import RESERVED
from kvstore.errors import (
    InvalidRequestError,
    ReservationClosedError,
)
from tests.engine_helpers import DO, NO_WATERMARKS, NS, KiB, MiB, later, make_rig, present, put, touch

# A policy that loops over ineligible entries must fail the test, not hang the run.
pytestmark = pytest.mark.timeout(120)


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
