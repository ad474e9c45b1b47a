"""The RAM-tier engine, built from its real small parts (layout math, a numpy generation table, a slab allocator,
a policy) and driven with commented scripts; every check is an exact value. Here: namespaces, reserve / commit /
lookup, and validation. Eviction: test_engine_eviction.py; leases, reservations, delete, pin, clear, list:
test_engine_lifetimes.py; stats and memory: test_engine_stats.py.

Default rig (tests/engine_helpers.py): 4 MiB of data in 1 MiB slabs (4 slabs; max_block_bytes = slab), data at
DO = 2 MiB, so slab i starts at DO + i MiB and its generation sits at index i * 256 of the table.
"""

from __future__ import annotations

import pytest

from kvstore.engine.results import ALREADY_PRESENT, IN_FLIGHT, RESERVED
from kvstore.errors import (
    BatchTooLargeError,
    ConflictError,
    InvalidRequestError,
    ReservationClosedError,
    UnknownNamespaceError,
    UnknownReservationError,
)
from tests.engine_helpers import DO, NS, KiB, MiB, make_rig, present, put

# A policy that loops over ineligible entries must fail the test, not hang the run.
pytestmark = pytest.mark.timeout(120)


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
