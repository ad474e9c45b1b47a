"""The engine across RAM and disk, built from real parts (the rig: tests/tiering_rig.py): write-behind, eviction
that is metadata only, promotion back into RAM (prefetch, prefix lookups mixing tiers, one promotion per key, no
slot, corruption, an entry reused by another namespace mid-promotion), and deletes racing the disk I/O.
Commented scripts; every check is an exact value. Admission, disk-only keys, restart and segment reclamation:
test_engine_tiering_disk.py.
"""

from __future__ import annotations

import threading

import pytest

from kvstore.testing import wait_until
from tests.tiering_rig import BLOCK, DISK, NONE, NS, RAM, rig_fixture, value

pytestmark = pytest.mark.timeout(60)
make_rig = rig_fixture()


# ----------------------------------------------------------------------------------------- write-behind, promotion


def test_write_behind_then_evict_is_metadata_only_then_promote(make_rig) -> None:
    rig = make_rig()
    eng = rig.engine
    # commit k0 -> the writer copies it to disk soon after; the RAM copy is flagged ON_DISK
    rig.put([b"k0"])
    rig.wait_written(1)
    assert eng.stats().disk.blocks == 1
    assert [r.tier for r in eng.describe(NS, [b"k0"])] == ["ram+disk"]
    # fill the arena (k1..k3, all written behind), then k4 needs k0's slot: LRU evicts k0, a metadata-only drop
    rig.put([b"k1", b"k2", b"k3"])
    rig.wait_written(4)
    rig.put([b"k4"])
    c = eng.stats().counters
    assert (c["evictions"], c["evicted_to_disk"]) == (1, 1)
    rig.wait_written(5)  # k4's write-behind; the eviction of k0 wrote nothing
    assert eng.stats().disk.blocks == 5
    # a get of k0: found on disk (tier 2), promoted into the slot of the LRU k1 (also on disk), leased, exact bytes
    res = eng.lookup(NS, [b"k0"], lease=True)
    assert (res.present, res.tiers, res.sizes) == ([True], [DISK], [BLOCK])
    assert rig.read(res, 0) == value(b"k0")
    c = eng.stats().counters
    assert (c["promotions"], c["promotion_failures"], c["hit_keys_disk"], c["hit_keys_ram"]) == (1, 0, 1, 0)
    assert (c["evictions"], c["evicted_to_disk"], c["disk_writes"]) == (2, 2, 5)  # a promoted block is not rewritten
    assert eng.release([res.lease_id]) == 1
    # now a RAM hit, still with its disk copy
    res = eng.lookup(NS, [b"k0", b"k1"], lease=False)
    assert (res.present, res.tiers) == ([True, True], [RAM, DISK])
    assert [r.tier for r in eng.describe(NS, [b"k0"])] == ["ram+disk"]


def test_probe_without_lease_prefetches_into_ram(make_rig) -> None:
    rig = make_rig()
    eng = rig.engine
    rig.put_disk_only([b"d"])
    # the scheduler's probe: answers at once, counting the disk hit as present; the promotion runs behind it
    res = eng.lookup(NS, [b"d"], lease=False)
    assert (res.num_prefix, res.present, res.tiers, res.lease_id) == (1, [True], [DISK], 0)
    wait_until(lambda: eng.lookup(NS, [b"d"], lease=False).tiers == [RAM], timeout_s=10, what="promotion")
    c = eng.stats().counters
    assert (c["promotions"], c["promotion_failures"]) == (1, 0)
    res = eng.lookup(NS, [b"d"], lease=True)
    assert res.tiers == [RAM] and rig.read(res, 0) == value(b"d")
    eng.release([res.lease_id])


def test_prefix_lookup_mixing_ram_disk_and_a_miss(make_rig) -> None:
    rig = make_rig(admission="never")  # RAM blocks stay RAM-only: no writer holds in the leases column
    eng = rig.engine
    rig.put([b"a", b"c", b"e"])  # 3 of the 4 slots
    rig.put_disk_only([b"b"])
    keys = [b"a", b"b", b"c", b"x", b"e"]  # RAM, disk, RAM, miss, RAM
    # the get: b is promoted into the 4th slot; prefix stops at the miss; the lease covers exactly a, b, c
    res = eng.lookup(NS, keys, prefix=True, lease=True)
    assert (res.num_prefix, res.present, res.tiers) == (3, [True, True, True, False], [RAM, DISK, RAM, NONE])
    assert [rig.read(res, j) for j in range(3)] == [value(k) for k in (b"a", b"b", b"c")]
    assert rig.leases([b"a", b"b", b"c", b"e"]) == [1, 1, 1, 0]  # e, after the miss, is not held
    assert eng.stats().leased_bytes == 3 * BLOCK
    assert eng.release([res.lease_id]) == 1
    assert rig.leases([b"a", b"b", b"c", b"e"]) == [0, 0, 0, 0]
    assert eng.stats().leased_bytes == 0
    # the probe: b is in RAM now; nothing is held
    res = eng.lookup(NS, keys, prefix=True, lease=False)
    assert (res.num_prefix, res.present, res.tiers, res.lease_id) == (3, [True, True, True, False],
                                                                       [RAM, RAM, RAM, NONE], 0)
    c = eng.stats().counters
    assert (c["promotions"], c["hit_keys_disk"], c["hit_keys_ram"]) == (1, 1, 5)


def test_same_disk_key_twice_in_one_lookup_is_one_promotion(make_rig) -> None:
    rig = make_rig(admission="never")
    eng = rig.engine
    rig.put_disk_only([b"d"])
    res = eng.lookup(NS, [b"d", b"d"], lease=True)
    assert (res.present, res.tiers) == ([True, True], [DISK, DISK])
    assert res.offsets[0] == res.offsets[1] and rig.read(res, 1) == value(b"d")
    st = eng.stats()
    assert (st.counters["promotions"], st.blocks, st.allocated_bytes) == (1, 1, BLOCK)
    assert rig.leases([b"d"]) == [2]
    eng.release([res.lease_id])
    assert rig.leases([b"d"]) == [0]


def test_promotion_without_a_slot_is_a_miss_and_keeps_the_lookups_ram_hits(make_rig) -> None:
    rig = make_rig(admission="never")
    eng = rig.engine
    rig.put([b"r0", b"r1", b"r2", b"r3"])  # arena full
    rig.put_disk_only([b"d"])
    held = eng.lookup(NS, [b"r1", b"r2", b"r3"], lease=True)  # leased by another reader: not evictable
    # probe [r0, d]: the only evictable block is r0, a hit of this very lookup -> d gets no slot -> a miss
    res = eng.lookup(NS, [b"r0", b"d"], lease=False)
    assert (res.present, res.tiers) == ([True, False], [RAM, DISK])
    c = eng.stats().counters
    assert (c["promotions"], c["promotion_failures"], c["evictions"]) == (0, 1, 0)
    assert eng.exists(NS, [b"r0", b"d"]) == [True, True]
    # get with prefix [r0, d, r1]: r0 and r1 are held while d is tried; r1 (after the first miss) is given back
    res = eng.lookup(NS, [b"r0", b"d", b"r1"], prefix=True, lease=True)
    assert (res.num_prefix, res.present, res.tiers) == (1, [True, False], [RAM, DISK])
    assert eng.stats().counters["promotion_failures"] == 2
    assert rig.leases([b"r0", b"r1", b"r2", b"r3"]) == [1, 1, 1, 1]  # r1: only `held`'s lease
    assert eng.release([res.lease_id, held.lease_id]) == 2
    assert rig.leases([b"r0", b"r1", b"r2", b"r3"]) == [0, 0, 0, 0]
    assert eng.stats().allocated_bytes == 4 * BLOCK


def test_corrupted_disk_block_is_a_miss_and_frees_its_slot(make_rig) -> None:
    rig = make_rig(admission="never")
    eng = rig.engine
    rig.put([b"r0", b"r1"])
    rig.put_disk_only([b"bad"])
    rec = rig.disk.lookup(NS, b"bad")
    assert rec is not None
    with open(rig.disk.segment_path(rec.segment), "r+b") as fh:  # flip the block's first 16 bytes
        fh.seek(rec.offset)
        first = fh.read(16)
        fh.seek(rec.offset)
        fh.write(bytes(b ^ 0xFF for b in first))
    res = eng.lookup(NS, [b"r0", b"bad", b"r1"], prefix=True, lease=True)
    assert (res.num_prefix, res.present, res.tiers) == (1, [True, False], [RAM, DISK])
    c = eng.stats().counters
    assert (c["promotions"], c["checksum_failures"], c["promotion_failures"], c["hit_keys_disk"]) == (1, 1, 1, 0)
    assert eng.stats().allocated_bytes == 2 * BLOCK  # the promotion's slot is back
    assert rig.leases([b"r0", b"r1"]) == [1, 0]
    eng.release([res.lease_id])
    # the disk tier dropped the bad entry: the key is gone everywhere
    assert eng.exists(NS, [b"bad"]) == [False]
    assert eng.stats().disk.blocks == 0


# ----------------------------------------------------------------------------------------- deletes racing I/O


def test_delete_during_promotion_cancels_it(make_rig) -> None:
    rig = make_rig()
    eng = rig.engine
    rig.put_disk_only([b"d"])
    rig.io.armed = "pread"  # the promoter's read waits at the gate
    assert eng.lookup(NS, [b"d"], lease=False).present == [True]
    assert rig.io.entered.wait(10)
    assert eng.stats().allocated_bytes == BLOCK  # the promotion's slot
    assert eng.delete(NS, [b"d"]) == 1
    assert eng.exists(NS, [b"d"]) == [False]
    assert eng.stats().disk.blocks == 0
    rig.io.gate.set()  # the read returns: the cancelled promotion gives its slot back
    wait_until(lambda: eng.stats().allocated_bytes == 0, timeout_s=10, what="the cancelled promotion's slot")
    res = eng.lookup(NS, [b"d"], lease=True)
    assert (res.present, res.tiers) == ([False], [NONE])
    st = eng.stats()
    assert (st.blocks, st.counters["promotions"], st.counters["promotion_failures"]) == (0, 1, 1)


def test_delete_during_write_behind_removes_the_late_disk_copy(make_rig) -> None:
    rig = make_rig()
    eng = rig.engine
    rig.io.armed = "pwrite"  # the writer's pwrite waits at the gate, holding the slot
    rig.put([b"k"])
    assert rig.io.entered.wait(10)
    assert eng.delete(NS, [b"k"]) == 1  # leased by the writer: hidden now, freed when the write ends
    assert eng.exists(NS, [b"k"]) == [False]
    assert eng.stats().allocated_bytes == BLOCK
    rig.io.gate.set()
    # the write lands, the writer sees the block was deleted and deletes the disk copy; the slot is freed
    wait_until(lambda: eng.counters.disk_writes == 1 and eng.stats().allocated_bytes == 0
               and eng.stats().disk.blocks == 0, timeout_s=10, what="the stale disk copy to go")
    assert eng.exists(NS, [b"k"]) == [False]
    assert eng.lookup(NS, [b"k"], lease=False).tiers == [NONE]
    assert eng.list_keys(NS, b"", 10) == ([], b"")


def test_a_joined_promotion_whose_entry_was_reused_by_another_namespace_is_a_miss(make_rig) -> None:
    """Issue 16 item 7, confirmed: a get waits for its promotion; the promotion commits, and before the waiting
    get re-takes the lock the block is deleted and its entry id and slot are reused by ANOTHER namespace's block
    with the same key bytes (chained keys do not depend on the namespace: two salts or models share them).
    Checking the key alone leased the other namespace's block (another model's KV); now it is a miss."""
    rig = make_rig(admission="never")
    eng = rig.engine
    other = "m@2/other"
    assert eng.register_namespace(other) is True
    rig.put_disk_only([b"k"])
    reused: dict[str, int] = {}

    class Interleave(threading.Event):
        def set(self) -> None:  # runs in the promoter thread right after the commit, outside the lock
            if not reused:
                gone = eng.delete(NS, [b"k"])
                r = eng.reserve(other, [b"k"], [BLOCK])
                rig.mm[r.offsets[0]: r.offsets[0] + BLOCK] = b"\x77" * BLOCK
                eng.commit(r.reservation_id)
                reused.update(deleted=gone, offset=r.offsets[0])
            super().set()

    enqueue = eng._disk.mover.enqueue_promotions  # noqa: SLF001

    def hooked(ps) -> None:
        for p in ps:
            p.done = Interleave()
        enqueue(ps)

    eng._disk.mover.enqueue_promotions = hooked  # noqa: SLF001
    res = eng.lookup(NS, [b"k"], lease=True)
    assert reused["deleted"] == 1
    assert (res.present, res.offsets, res.lease_id) == ([False], [], 0)
    assert [r.leases for r in eng.describe(other, [b"k"])] == [0]   # the other block was not leased either
    got = eng.lookup(other, [b"k"], lease=True)
    assert got.offsets == [reused["offset"]] and rig.read(got, 0) == b"\x77" * BLOCK
    eng.release([got.lease_id])
