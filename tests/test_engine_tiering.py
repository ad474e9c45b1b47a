"""The engine across RAM and disk, built from real parts: a real DiskStore in tmp_path, a real (anonymous, page-
aligned) mapping as the arena, the real Mover threads. Commented scripts; every check is an exact value.

Rig: 4 slabs of 64 KiB (4 blocks of BLOCK bytes; max_block_bytes = slab), no watermark eviction, so a block
leaves RAM only when a reserve or promotion needs its slot. Disk: 4 MiB in 1 MiB segments, sync="none".
Block contents are a pure function of the key. "Disk-only" keys are written straight into the DiskStore.
Background work is awaited by polling with a deadline (wait_until), never by sleeping.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.results import ALREADY_PRESENT, RESERVED, EngineConfig, LookupResult
from kvstore.errors import ConflictError
from kvstore.policies import make_policy
from kvstore.policies.admission import make_admission
from kvstore.testing import wait_until
from kvstore.testing.gated_io import GatedIO
from kvstore.tiers.disk import AlignedBuffer, DiskConfig, DiskStatus, DiskStore, WriteItem

pytestmark = pytest.mark.timeout(60)

KiB, MiB = 1024, 1024 * 1024
BLOCK = 64 * KiB
NS = "m@1/tiering"
RAM, DISK, NONE = 1, 2, 0


def value(key: bytes) -> bytes:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return random.Random(seed).randbytes(BLOCK)


@dataclass
class Rig:
    engine: Engine
    disk: DiskStore
    io: GatedIO
    mm: mmap.mmap

    def put(self, keys: list[bytes]) -> list[int]:
        """Reserve, copy each block's bytes into its slot, commit; the offsets."""
        r = self.engine.reserve(NS, keys, [BLOCK] * len(keys))
        assert r.outcomes == [RESERVED] * len(keys)
        for k, off in zip(keys, r.offsets):
            self.mm[off: off + BLOCK] = value(k)
        assert self.engine.commit(r.reservation_id) == len(keys)
        return r.offsets

    def put_disk_only(self, keys: list[bytes]) -> None:
        """Write blocks straight into the disk tier (the engine never had them in RAM)."""
        buf = AlignedBuffer(BLOCK)
        try:
            for k in keys:
                buf.view(BLOCK)[:] = value(k)
                assert self.disk.write_many([WriteItem(NS, k, buf.address, BLOCK)]) == [DiskStatus.OK]
        finally:
            buf.close()

    def read(self, res: LookupResult, j: int) -> bytes:
        off, size = res.offsets[j], res.sizes[j]
        return bytes(self.mm[off: off + size])

    def counter(self, name: str) -> int:
        return self.engine.stats().counters[name]

    def wait_written(self, n: int) -> None:
        """Wait until the writer has finished `n` writes in all (and released their slot holds)."""
        wait_until(lambda: self.counter("disk_writes") == n and self.engine.stats().leased_bytes == 0
                   and self.engine.write_queue_blocks == 0, timeout_s=10, what=f"{n} disk writes")

    def leases(self, keys: list[bytes]) -> list[int]:
        return [r.leases for r in self.engine.describe(NS, keys)]


@pytest.fixture
def make_rig(tmp_path) -> Iterator[Callable[..., Rig]]:
    """Rig factory; every rig is stopped and its store closed at the end (a rig may be made twice on one dir)."""
    made: list[Rig] = []

    def make(admission: str = "always", start: bool = True, register: bool = True, disk_bytes: int = 4 * MiB,
             reinsert_hits: int = 1) -> Rig:
        io = GatedIO()
        disk = DiskStore(DiskConfig(directory=str(tmp_path / "disk"), capacity_bytes=disk_bytes, segment_bytes=MiB,
                                    sync="none", reinsert_hits=reinsert_hits), io=io)
        disk.open()
        layout = ArenaLayout.for_capacity("x", 4 * BLOCK, BLOCK)
        mm = mmap.mmap(-1, layout.size_bytes)  # anonymous: page-aligned, zeroed
        anchor = (ctypes.c_char * 1).from_buffer(mm)
        address = ctypes.addressof(anchor)
        del anchor
        gens = np.frombuffer(mm, dtype=np.uint64, count=layout.gen_table_bytes // 8)
        engine = Engine(EngineConfig(max_block_bytes=BLOCK, high_watermark=1.0, low_watermark=1.0), layout, gens,
                        SlabAllocator(layout.data_offset, layout.data_bytes, BLOCK), make_policy("lru"),
                        disk=disk, admission=make_admission(admission), arena_address=address)
        if register:
            assert engine.register_namespace(NS) is True
        if start:
            engine.start()
        made.append(Rig(engine, disk, io, mm))
        return made[-1]

    yield make
    for rig in made:
        rig.io.gate.set()
        rig.engine.stop()
        rig.disk.close()


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

    enqueue = eng._disk.mover.enqueue_promotion  # noqa: SLF001

    def hooked(p) -> None:
        p.done = Interleave()
        enqueue(p)

    eng._disk.mover.enqueue_promotion = hooked  # noqa: SLF001
    res = eng.lookup(NS, [b"k"], lease=True)
    assert reused["deleted"] == 1
    assert (res.present, res.offsets, res.lease_id) == ([False], [], 0)
    assert [r.leases for r in eng.describe(other, [b"k"])] == [0]   # the other block was not leased either
    got = eng.lookup(other, [b"k"], lease=True)
    assert got.offsets == [reused["offset"]] and rig.read(got, 0) == b"\x77" * BLOCK
    eng.release([got.lease_id])
