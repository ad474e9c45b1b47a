"""The engine's disk side, built from real parts (the rig: tests/tiering_rig.py): admission policies, keys that
live on disk only (reserve, exists, delete, clear, list, describe), recovery of namespaces and blocks at restart,
and reclamation of disk segments (second chance for read blocks, plain FIFO). "Disk-only" keys are written
straight into the DiskStore. Every check is an exact value.
"""

from __future__ import annotations

import pytest

from kvstore.engine.results import ALREADY_PRESENT, RESERVED
from kvstore.errors import ConflictError
from tests.tiering_rig import BLOCK, DISK, NONE, NS, RAM, MiB, rig_fixture, value

pytestmark = pytest.mark.timeout(60)
make_rig = rig_fixture()


# ----------------------------------------------------------------------------------------- admission


def test_admission_seen_twice(make_rig) -> None:
    rig = make_rig(admission="seen:2", start=False)  # no writer yet: the queue shows what was admitted
    eng = rig.engine
    rig.put([b"k"])
    assert eng.write_queue_blocks == 0  # put once: seen 1 < 2
    eng.lookup(NS, [b"k"], lease=False)
    assert eng.write_queue_blocks == 1  # one hit: seen 2 -> queued
    eng.lookup(NS, [b"k"], lease=False)
    assert eng.write_queue_blocks == 1  # already queued: not twice
    eng.start()
    rig.wait_written(1)
    assert eng.stats().disk.blocks == 1
    assert [r.tier for r in eng.describe(NS, [b"k"])] == ["ram+disk"]
    eng.lookup(NS, [b"k"], lease=False)
    assert eng.write_queue_blocks == 0  # on disk already: never queued again


def test_admission_never_writes_nothing(make_rig) -> None:
    rig = make_rig(admission="never")
    eng = rig.engine
    rig.put([b"k"])
    for _ in range(3):
        eng.lookup(NS, [b"k"], lease=False)
    eng.stop()  # finishes queued writes: a barrier
    assert eng.stats().counters["disk_writes"] == 0
    assert eng.stats().disk.blocks == 0


# ----------------------------------------------------------------------------------------- keys on disk only


def test_disk_only_key_reserve_exists_delete_and_clear(make_rig) -> None:
    rig = make_rig(admission="seen:2")
    eng = rig.engine
    rig.put_disk_only([b"d"])
    r = eng.reserve(NS, [b"d", b"new"], [BLOCK, BLOCK])
    assert r.outcomes == [ALREADY_PRESENT, RESERVED] and r.offsets[0] == 0
    eng.abort(r.reservation_id)
    assert eng.exists(NS, [b"d", b"new"]) == [True, False]
    assert eng.delete(NS, [b"d"]) == 1
    assert eng.stats().disk.blocks == 0
    assert eng.exists(NS, [b"d"]) == [False]
    # clear_namespace: a (RAM + disk), b (RAM only), c (disk only) -> 3 distinct keys
    rig.put([b"a", b"b"])
    eng.lookup(NS, [b"a"], lease=False)  # second use of a: admitted and written
    rig.wait_written(1)
    rig.put_disk_only([b"c"])
    assert [r.tier for r in eng.describe(NS, [b"a", b"b", b"c"])] == ["ram+disk", "ram", "disk"]
    assert eng.clear_namespace(NS) == 3
    st = eng.stats()
    assert (st.blocks, st.allocated_bytes, st.disk.blocks) == (0, 0, 0)
    assert eng.exists(NS, [b"a", b"b", b"c"]) == [False] * 3


def test_list_and_describe_across_tiers_with_pagination(make_rig) -> None:
    rig = make_rig(admission="seen:2")
    eng = rig.engine
    rig.put([b"k1", b"k3", b"k5", b"k6"])
    eng.lookup(NS, [b"k3", b"k6"], lease=False)  # admitted on their second use
    rig.wait_written(2)
    rig.put_disk_only([b"k0", b"k2", b"k4", b"k7"])
    expected = {b"k0": "disk", b"k1": "ram", b"k2": "disk", b"k3": "ram+disk", b"k4": "disk", b"k5": "ram",
                b"k6": "ram+disk", b"k7": "disk"}
    recs = eng.describe(NS, [b"k3", b"nope", b"k1", b"k0"])
    assert [(r.key, r.tier, r.size) for r in recs] == [(b"k3", "ram+disk", BLOCK), (b"k1", "ram", BLOCK),
                                                      (b"k0", "disk", BLOCK)]
    for limit in (1, 2, 3, 8):
        seen: list[tuple[bytes, str]] = []
        cursor, pages = b"", 0
        while True:
            page, cursor = eng.list_keys(NS, cursor, limit)
            pages += 1
            assert len(page) <= limit
            seen += [(r.key, r.tier) for r in page]
            if not cursor:
                break
            assert pages < 20
        assert seen == sorted(expected.items()), f"limit={limit}"


# ----------------------------------------------------------------------------------------- restart


def test_restart_recovers_namespaces_and_blocks_from_disk(make_rig) -> None:
    rig = make_rig()
    rig.put([b"a", b"b"])
    rig.wait_written(2)
    rig.engine.stop()
    rig.disk.close()
    # a new store on the same directory, a new engine with a fresh (empty) arena
    rig2 = make_rig(register=False)
    eng = rig2.engine
    assert [n.name for n in eng.stats().namespaces] == [NS]  # recovered from the disk tier
    assert eng.register_namespace(NS, model="llama", layout_digest="3f2a") is False  # adopted, no conflict
    with pytest.raises(ConflictError):
        eng.register_namespace(NS, model="other")  # adopted: the description now holds
    res = eng.lookup(NS, [b"a", b"b", b"x"], lease=True)
    assert (res.present, res.tiers) == ([True, True, False], [DISK, DISK, NONE])
    assert [rig2.read(res, j) for j in range(2)] == [value(b"a"), value(b"b")]
    assert eng.stats().counters["promotions"] == 2
    eng.release([res.lease_id])


# ----------------------------------------------------------------------------------- reclamation of disk segments

def _k(i: int) -> bytes:
    return b"k%02d" % i


def _kv(e) -> tuple:
    return (e.kind, e.keys, e.tier, e.to_tier)


def test_reclamation_keeps_read_blocks_drops_the_rest_and_publishes_it(make_rig) -> None:
    # Disk: 2 segments of 16 blocks (A, B). RAM: 4 slots, one of them held by the pinned k00 throughout.
    rig = make_rig(disk_bytes=2 * MiB)
    eng = rig.engine
    rig.put([_k(0)])
    assert eng.pin(NS, [_k(0)], +1) == 1
    written = 1
    for i in range(1, 16, 3):                # k01..k15 in puts of 3: segment A = k00..k15
        rig.put([_k(j) for j in range(i, min(i + 3, 16))])
        written += min(3, 16 - i)
        rig.wait_written(written)
    res = eng.lookup(NS, [_k(1)], lease=True)   # a get of k01 promotes it: a read of its record in A
    assert res.tiers == [DISK] and rig.read(res, 0) == value(_k(1))
    eng.release([res.lease_id])
    for i in range(16, 32, 3):               # k16..k31: segment B; RAM ends as k00 (pinned), k29, k30, k31
        rig.put([_k(j) for j in range(i, min(i + 3, 32))])
        written += min(3, 32 - i)
        rig.wait_written(written)
    sub = eng.events.subscribe([NS])
    # k32-k34 evict k29-k31 (their disk copies stay). Their write reclaims A: k01 was read, so it is copied to
    # A's start; k00 and k02-k15 leave the disk, k00's RAM copy with them. The commit's blocks got the entry ids
    # freed by k31, k30, k29 (reused last-freed-first) but are written in the commit's order, after k01.
    rig.put([_k(32), _k(33), _k(34)])
    rig.wait_written(written + 3)
    dropped = tuple(_k(i) for i in [0] + list(range(2, 16)))
    assert [_kv(sub.next(0)) for _ in range(8)] == [
        ("moved", (_k(29),), RAM, DISK), ("moved", (_k(30),), RAM, DISK), ("moved", (_k(31),), RAM, DISK),
        ("stored", (_k(32), _k(33), _k(34)), RAM, 0),
        ("removed", dropped, DISK, 0),
        ("stored", (_k(32),), DISK, 0), ("stored", (_k(33),), DISK, 0), ("stored", (_k(34),), DISK, 0),
    ]
    assert sub.next(0) is None
    a = rig.disk.lookup(NS, _k(1)).segment
    assert [(r.segment, r.offset // BLOCK) for r in (rig.disk.lookup(NS, _k(i)) for i in (1, 32, 33, 34))] == [
        (a, 0), (a, 1), (a, 2), (a, 3)]
    d = eng.stats().disk
    assert (d.blocks, d.evicted_blocks, d.reinserted_blocks) == (32 + 3 - 15, 15, 1)
    c = eng.stats().counters
    # evictions: 12 by k04-k15 (3 free slots beside k00), 1 by k01's promotion, 16 by k16-k31, 3 by k32-k34
    assert (c["disk_reinserted"], c["disk_writes"], c["evictions"], c["evicted_to_disk"]) == (1, 35, 32, 32)
    assert eng.exists(NS, [_k(0), _k(1), _k(2), _k(15), _k(16)]) == [True, True, False, False, True]
    assert [r.tier for r in eng.describe(NS, [_k(0)])] == ["ram"]
    # k00 unpinned is the LRU block: k35 evicts it, and with its disk copy gone that is a removal from RAM
    assert eng.pin(NS, [_k(0)], -1) == 1
    rig.put([_k(35)])
    rig.wait_written(written + 4)
    assert [_kv(sub.next(0)) for _ in range(3)] == [
        ("removed", (_k(0),), RAM, 0), ("stored", (_k(35),), RAM, 0), ("stored", (_k(35),), DISK, 0)]
    c = eng.stats().counters
    assert (c["evictions"], c["evicted_to_disk"]) == (33, 32)
    assert eng.exists(NS, [_k(0)]) == [False]
    # k01 came back from its copy, bytes intact
    res = eng.lookup(NS, [_k(1)], lease=True)
    assert res.tiers == [DISK] and rig.read(res, 0) == value(_k(1))
    eng.release([res.lease_id])
    sub.close()


def test_plain_fifo_reclamation_drops_read_blocks_too(make_rig) -> None:
    rig = make_rig(disk_bytes=2 * MiB, reinsert_hits=0)
    eng = rig.engine
    for i in range(0, 32, 4):
        rig.put([_k(j) for j in range(i, i + 4)])
        rig.wait_written(i + 4)
    res = eng.lookup(NS, [_k(1)], lease=True)   # read k01 from segment A
    eng.release([res.lease_id])
    rig.put([_k(32)])
    rig.wait_written(33)
    assert eng.exists(NS, [_k(i) for i in range(16)]) == [False, True] + [False] * 14   # k01: its RAM copy only
    d = eng.stats().disk
    assert (d.evicted_blocks, d.reinserted_blocks, eng.stats().counters["disk_reinserted"]) == (16, 0, 0)
