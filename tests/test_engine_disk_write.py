"""disk_write = evict in the engine, built from real parts (the rig: tests/tiering_rig.py, 4 RAM slots of 64 KiB,
LRU, watermarks 1.0 so only a Reserve or a promotion evicts). Each test is a commented script with exact values:
what is written when RAM evicts, what is not, and that a slot is reused only after its block's write landed.
"""

from __future__ import annotations

import threading

import pytest

from kvstore.errors import StoreFullError
from kvstore.policies.write_budget import WriteBudget
from kvstore.testing import wait_until
from tests.tiering_rig import BLOCK, NS, rig_fixture, value

pytestmark = pytest.mark.timeout(60)
make_rig = rig_fixture()


def _tiers(eng, keys: list[bytes]) -> list[str]:
    return [r.tier if r is not None else "none" for r in eng.describe(NS, keys)]


def _counters(eng, *names: str) -> list[int]:
    c = eng.stats().counters
    return [c[n] for n in names]


def _get(rig, keys: list[bytes]) -> None:
    """A leased Lookup of `keys` (promotions waited for): every byte checked, the lease released."""
    res = rig.engine.lookup(NS, keys, lease=True)
    assert res.present == [True] * len(keys)
    assert [rig.read(res, j) for j in range(len(keys))] == [value(k) for k in keys]
    rig.engine.release([res.lease_id])


def test_a_victim_is_written_before_its_slot_is_reused_and_a_promoted_block_keeps_its_copy(make_rig) -> None:
    rig = make_rig(write_mode="evict")
    eng = rig.engine
    a = [b"a0", b"a1", b"a2", b"a3"]
    rig.put(a)                                     # RAM full; nothing written at commit
    assert _counters(eng, "disk_writes", "disk_writes_queued") == [0, 0]
    assert _tiers(eng, a) == ["ram"] * 4
    rig.put([b"b0"])                               # evicts a0 (LRU): written first, then its slot holds b0
    assert _counters(eng, "disk_writebacks", "disk_writes", "evictions", "evicted_to_disk", "room_waits") == [
        1, 1, 1, 1, 1]
    assert _tiers(eng, [b"a0", b"b0"]) == ["disk", "ram"]
    _get(rig, [b"a0"])                             # promoted: its victim a1 is written first, then a0 read back
    assert _counters(eng, "promotions", "disk_writes", "evictions") == [1, 2, 2]
    assert _tiers(eng, [b"a0", b"a1"]) == ["ram+disk", "disk"]
    for k in (b"a2", b"a3", b"b0"):                # a0 becomes the least recent
        _get(rig, [k])
    rig.put([b"c0"])                               # evicts a0: it has its disk copy, nothing is written
    assert _counters(eng, "disk_writes", "evictions", "evicted_to_disk", "disk_writebacks") == [2, 3, 3, 2]
    assert _tiers(eng, [b"a0", b"a1", b"c0"]) == ["disk", "disk", "ram"]
    assert eng.stats().disk.blocks == 2
    _get(rig, [b"a1"])                             # every block is exact wherever it lives
    assert eng.stats().counters["checksum_failures"] == 0


def test_admission_decides_at_eviction(make_rig) -> None:
    rig = make_rig(write_mode="evict", admission="seen:2")
    eng = rig.engine
    rig.put([b"a0", b"a1", b"a2", b"a3"])
    eng.lookup(NS, [b"a1"], lease=False)          # a1 used twice (put + hit): admitted; a0 once: not
    rig.put([b"b0", b"b1"])                        # evicts a0 (dropped), then a2 (seen once: dropped)
    assert _counters(eng, "evicted_unwritten", "disk_writebacks", "evictions") == [2, 0, 2]
    rig.put([b"b2", b"b3"])                        # evicts a3 (dropped), then a1 (written)
    assert _counters(eng, "evicted_unwritten", "disk_writebacks", "disk_writes", "evictions") == [3, 1, 1, 4]
    assert eng.exists(NS, [b"a0", b"a1", b"a2", b"a3"]) == [False, True, False, False]
    assert _tiers(eng, [b"a1"]) == ["disk"]


def test_never_writes_nothing_at_eviction(make_rig) -> None:
    rig = make_rig(write_mode="evict", admission="never")
    eng = rig.engine
    keys = [f"k{i}".encode() for i in range(8)]
    rig.put(keys[:4])
    rig.put(keys[4:])
    assert _counters(eng, "evicted_unwritten", "disk_writes_queued", "evictions") == [4, 0, 4]
    assert eng.stats().disk.blocks == 0


def test_release_lets_go_on_both_tiers(make_rig) -> None:
    rig = make_rig(write_mode="evict")
    eng = rig.engine
    rig.put_disk_only([b"d0", b"d1"])
    _get(rig, [b"d1"])                             # d1 in RAM with its disk copy
    rig.put([b"a0", b"a1"])
    assert eng.hint(NS, [b"d0", b"d1", b"a1"], "release") == ["accepted"] * 3
    assert eng.exists(NS, [b"d0"]) == [False]      # only on disk: deleted
    assert _tiers(eng, [b"d1", b"a1"]) == ["ram", "ram"]  # RAM copies stay, their disk copy (d1's) is gone
    assert eng.stats().disk.blocks == 0
    rig.put([b"b0", b"b1", b"b2"])                 # two evictions: the released ones first, written nowhere
    assert _counters(eng, "evicted_unwritten", "disk_writes", "evictions") == [2, 0, 2]
    assert eng.exists(NS, [b"d1", b"a1", b"a0"]) == [False, False, True]
    rig.put([b"b3"])                               # a0 was not released: it is written when it goes
    assert _counters(eng, "disk_writes", "evictions") == [1, 3]
    assert _tiers(eng, [b"a0"]) == ["disk"]


def test_demote_writes_now_and_frees_the_slot_when_written(make_rig) -> None:
    rig = make_rig(write_mode="evict", admission="never")  # a Demote bypasses admission
    eng = rig.engine
    rig.put([b"a0", b"a1"])
    assert eng.hint(NS, [b"a1"], "demote") == ["deferred"]
    wait_until(lambda: eng.stats().counters["evictions"] == 1, timeout_s=10, what="the demoted block's write")
    assert _counters(eng, "disk_writes", "disk_writebacks", "evicted_to_disk") == [1, 1, 1]
    assert _tiers(eng, [b"a0", b"a1"]) == ["ram", "disk"]
    assert eng.stats().blocks == 1
    _get(rig, [b"a1"])


def test_a_reserve_waits_for_its_victims_writes(make_rig) -> None:
    rig = make_rig(write_mode="evict")
    eng = rig.engine
    rig.put([b"a0", b"a1", b"a2", b"a3"])
    rig.io.armed = "pwrite"                        # the write-back of a0 will wait at the gate
    done = threading.Event()
    t = threading.Thread(target=lambda: (rig.put([b"b0"]), done.set()), daemon=True)
    t.start()
    assert rig.io.entered.wait(10)
    st = eng.disk_writing()
    assert (st.write_mode, st.writeback_blocks) == ("evict", 1)
    assert _tiers(eng, [b"a0"]) == ["ram"]         # still readable while it is written
    _get(rig, [b"a0"])
    assert not done.is_set()                       # the Reserve waits: a0's slot is not free yet
    rig.io.gate.set()
    assert done.wait(10)
    t.join(10)
    assert _tiers(eng, [b"a0", b"b0"]) == ["disk", "ram"]
    assert eng.disk_writing().writeback_blocks == 0


def test_a_reserve_gives_up_when_the_writes_do_not_land(make_rig) -> None:
    rig = make_rig(write_mode="evict", promote_timeout_s=0.3)
    eng = rig.engine
    rig.put([b"a0", b"a1", b"a2", b"a3"])
    rig.io.armed = "pwrite"
    with pytest.raises(StoreFullError, match="still being written to the disk tier"):
        eng.reserve(NS, [b"b0"], [BLOCK])
    assert _counters(eng, "store_full", "room_waits") == [1, 1]
    rig.io.gate.set()                              # the write lands later: a0 leaves RAM for the disk
    wait_until(lambda: eng.disk_writing().writeback_blocks == 0, timeout_s=10, what="a0's write")
    assert _tiers(eng, [b"a0"]) == ["disk"]
    rig.put([b"b0"])


def test_promoted_blocks_get_no_second_chance_and_are_written_again(make_rig) -> None:
    """Disk: 4 segments of 16 records. A promoted block's record (read once) is not kept when its segment is
    reclaimed while the block is in RAM; the RAM copy loses its disk copy and its next eviction writes it."""
    rig = make_rig(write_mode="evict")
    eng = rig.engine
    first = [f"f{i:02d}".encode() for i in range(20)]
    for k in first:                                # f00..f15 written into segment 0 as they are evicted
        rig.put([k])
    _get(rig, [b"f00"])                            # f00 promoted: in RAM, backed by its record in segment 0
    _get(rig, [b"f01"])
    for i in range(48):                            # fill segments 1..3, then reclaim segment 0; f00 and f01
        rig.put([f"g{i:02d}".encode()])            # stay the most recent in RAM
        _get(rig, [b"f00", b"f01"])
    assert eng.stats().disk.evicted_blocks == 16   # segment 0 reclaimed
    assert _tiers(eng, [b"f00", b"f01"]) == ["ram", "ram"]   # both in RAM, their disk copies dropped
    c = eng.stats().counters
    assert c["disk_reinserted"] == 0               # f00, f01 were read, but RAM holds them: no second chance
    before = c["disk_writes"]
    for i in range(4):                             # push f00 and f01 out of RAM: written again
        rig.put([f"h{i}".encode()])
    assert eng.stats().counters["disk_writes"] == before + 4
    assert _tiers(eng, [b"f00", b"f01"]) == ["disk", "disk"]
    _get(rig, [b"f00"])


def test_the_budget_refuses_past_its_window(make_rig) -> None:
    now = [0.0]
    budget = WriteBudget(BLOCK, window_s=1.0, clock=lambda: now[0], max_block_bytes=BLOCK)  # one block a second
    rig = make_rig(write_mode="evict", budget=budget)
    eng = rig.engine
    rig.put([b"a0", b"a1", b"a2", b"a3"])
    rig.put([b"b0", b"b1"])                        # a0 admitted (64 KiB of 64 KiB), a1 refused: dropped
    assert _counters(eng, "disk_writes", "evicted_unwritten") == [1, 1]
    assert eng.exists(NS, [b"a0", b"a1"]) == [True, False]
    b = eng.disk_writing().budget
    assert (b.admitted_blocks, b.refused_blocks, b.window_admitted, b.window_target) == (1, 1, BLOCK, BLOCK)
    now[0] = 1.0                                   # a new window: 2 blocks were offered for 1: p = 0.5
    assert eng.disk_writing().budget.probability == 0.5
    assert budget.refused_bytes == BLOCK and budget.admitted_bytes == BLOCK


def test_commit_mode_is_unchanged(make_rig) -> None:
    """disk_write = commit: written at commit (write-behind), a victim with its copy leaves without a write."""
    rig = make_rig()
    eng = rig.engine
    rig.put([b"a0", b"a1"])
    rig.wait_written(2)
    rig.put([b"a2", b"a3", b"b0"])
    rig.wait_written(5)
    assert _counters(eng, "disk_writes", "disk_writebacks", "evictions", "evicted_to_disk", "room_waits") == [
        5, 0, 1, 1, 0]
    assert eng.stats().disk.blocks == 5 and eng.disk_writing().write_mode == "commit"



def test_a_peer_guest_is_never_written_here(make_rig) -> None:
    """Copies the peer tier says this node does not own (Engine.let_go): dropped now or first to go, and under
    evict their eviction writes nothing (the owner has the block)."""
    rig = make_rig(write_mode="evict")
    eng = rig.engine
    rig.put([b"a0", b"a1", b"a2", b"a3"])
    assert eng.let_go(NS, [b"a1"], drop=True) == 1           # dropped now, unwritten
    assert eng.let_go(NS, [b"a2"]) == 1                      # first to go
    rig.put([b"b0", b"b1"])                                  # a free slot, then a2 goes first: unwritten
    assert _counters(eng, "disk_writes", "evicted_unwritten", "evictions") == [0, 2, 2]
    assert eng.exists(NS, [b"a0", b"a1", b"a2", b"a3"]) == [True, False, False, True]
    rig.put([b"b2"])                                         # a0, an own block: written when it goes
    assert _counters(eng, "disk_writes", "evicted_unwritten", "evictions") == [1, 2, 3]
