"""The RAM-tier engine when the store is full: all-or-nothing reserves, LRU eviction that skips leased, pinned,
reserved and in-flight blocks, watermark eviction, and both policies inside the engine. Commented scripts;
every check is an exact value.

Default rig (tests/engine_helpers.py): 4 MiB of data in 1 MiB slabs (4 slabs; max_block_bytes = slab), data at
DO = 2 MiB, so slab i starts at DO + i MiB and its generation sits at index i * 256 of the table.
"""

from __future__ import annotations

import pytest

from kvstore.engine.results import ALREADY_PRESENT, RESERVED
from kvstore.errors import (
    StoreFullError,
)
from tests.engine_helpers import DO, NO_WATERMARKS, NS, KiB, MiB, make_rig, present, put, touch

# A policy that loops over ineligible entries must fail the test, not hang the run.
pytestmark = pytest.mark.timeout(120)


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


def test_watermark_eviction_evicts_in_one_pass_with_every_effect_of_evicting_each() -> None:
    # 64 slots of 64 KiB, keys alternating between two namespaces; the 61st block evicts the 4 oldest (k00 NS,
    # k01 NS2, k02 NS, k03 NS2) in one pass: one event per namespace with its keys in LRU order, their slots'
    # generations bumped once, the key index and the miss ledger told, counters as for four single evictions
    rig = make_rig(data_bytes=4 * MiB, max_block=64 * KiB)
    eng = rig.engine
    assert eng.register_namespace("ns2") is True
    mirror = eng.attach_key_index(1024, 1, per_tenant=False)
    keys = [b"k%02d" % i for i in range(61)]
    spaces = [NS if i % 2 == 0 else "ns2" for i in range(61)]
    offsets = [put(eng, [k], size=64 * KiB, ns=n)[0] for k, n in zip(keys[:60], spaces)]
    assert mirror.counts() == {"": 60}
    gens = [rig.gen_at(off) for off in offsets[:5]]
    sub = eng.events.subscribe()
    put(eng, [keys[60]], size=64 * KiB)
    assert [(e.kind, e.namespace, e.keys) for e in iter(lambda: sub.next(0), None)] == [
        ("stored", NS, (keys[60],)), ("removed", NS, (keys[0], keys[2])), ("removed", "ns2", (keys[1], keys[3]))]
    assert [rig.gen_at(off) for off in offsets[:5]] == [g + 1 for g in gens[:4]] + [gens[4]]
    assert mirror.counts() == {"": 57}
    st = eng.stats()
    assert (st.blocks, st.allocated_bytes) == (57, 57 * 64 * KiB)
    assert (st.counters["evictions"], st.counters["evicted_bytes"], st.counters["evicted_to_disk"]) == (
        4, 4 * 64 * KiB, 0)
    assert [x.cause for x in eng.explain(NS, [keys[0], keys[2], keys[4]])] == ["evicted", "evicted", ""]
    assert [x.cause for x in eng.explain("ns2", [keys[1], keys[3], keys[5]])] == ["evicted", "evicted", ""]
    assert [eng.exists(n, [k]) for k, n in zip(keys, spaces)] == [[False]] * 4 + [[True]] * 57
    # the four freed slots (slabs: one 64 KiB slot each) are exactly the next four handed out
    assert sorted(put(eng, [b"n0", b"n1", b"n2", b"n3"], size=64 * KiB)) == sorted(offsets[:4])


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
