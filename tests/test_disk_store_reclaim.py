"""DiskStore's space: FIFO reclamation of the oldest segment, the second chance a record read since its write
gets at reclamation, and what a reopen keeps (blocks, FIFO order, reinserted records) or refuses.

Same shapes as tests/test_disk_store.py (tests/disk_store_helpers.py): 4 blocks of 256 KiB per 1 MiB segment,
capacity 3 segments, so FIFO reclamation can be read off the comments.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.testing.gated_io import GatedIO
from kvstore.tiers.disk import DiskStatus, DiskStore, FaultyIO, WriteItem
from tests.disk_store_helpers import OK, Buf, KiB, MiB, cfg, random_bytes, read, store_fixture, write

store = store_fixture()


# ------------------------------------------------------------------------------------- capacity / FIFO
def test_fill_past_capacity_reclaims_oldest_segment_first(store: DiskStore) -> None:
    # 3 segments of 1 MiB, blocks of 256 KiB: 4 blocks per segment.
    buf = Buf(MiB)
    blk = 256 * KiB
    data = {i: random_bytes(blk, i) for i in range(20)}
    key = lambda i: f"b{i:02d}".encode()  # noqa: E731
    for i in range(12):   # b00-b03 -> seg 0, b04-b07 -> seg 1, b08-b11 -> seg 2
        assert write(store, buf, "ns", {key(i): data[i]}) == [OK]
    assert store.stats().segments_free == 0 and store.stats().evicted_blocks == 0
    assert write(store, buf, "ns", {key(5): data[5]}) == [OK]   # rewrite b05: moves on, seg 2 full -> reclaim seg 0
    st = store.stats()
    assert (st.evicted_blocks, st.evicted_bytes) == (4, 4 * blk)
    assert store.contains_many("ns", [key(i) for i in range(4)]) == [0] * 4     # exactly seg 0's blocks gone
    assert store.lookup("ns", key(5)).segment == 0                               # type: ignore[union-attr]  # the key was just written: lookup finds it
    for i in range(12, 15):   # b12-b14 fill seg 0 (after b05)
        assert write(store, buf, "ns", {key(i): data[i]}) == [OK]
    assert write(store, buf, "ns", {key(15): data[15]}) == [OK]   # -> reclaims seg 1: b04, b06, b07 (not b05)
    st = store.stats()
    assert (st.evicted_blocks, st.evicted_bytes) == (7, 7 * blk)
    present = {i for i in range(16) if store.contains_many("ns", [key(i)])[0]}
    assert present == {5, *range(8, 16)}
    for i in present:
        assert read(store, "ns", key(i)) == (OK, data[i])
    assert st.blocks == 9 and st.used_bytes == 9 * blk and st.capacity_bytes == 3 * MiB


def test_a_segment_whose_records_were_all_deleted_is_reused_before_any_reclamation(store: DiskStore) -> None:
    # 3 segments of 4 blocks. Delete every block of seg 1 (a Release letting go of a session): the next write
    # that needs a segment takes seg 1 back with nothing dropped or copied, while seg 0 (oldest, all live) waits.
    # (A segment with a few live records left is cleaned instead: tests/test_disk_store_cleaning.py.)
    buf = Buf(MiB)
    blk = 256 * KiB
    key = lambda i: f"b{i:02d}".encode()  # noqa: E731
    data = {i: random_bytes(blk, 100 + i) for i in range(16)}
    for i in range(12):   # b00-b03 -> seg 0, b04-b07 -> seg 1, b08-b11 -> seg 2
        assert write(store, buf, "ns", {key(i): data[i]}) == [OK]
    assert store.delete("ns", [key(i) for i in (4, 5, 6, 7)]) == 4
    assert write(store, buf, "ns", {key(12): data[12]}) == [OK]   # seg 1 taken back: nothing reclaimed
    st = store.stats()
    assert (st.evicted_blocks, st.reinserted_blocks, st.cleaned_segments, st.blocks) == (0, 0, 0, 9)
    assert store.lookup("ns", key(12)).segment == 1                 # type: ignore[union-attr]  # just written
    for i in (*range(4), *range(8, 13)):
        assert read(store, "ns", key(i)) == (OK, data[i])


# ----------------------------------------------------------------------- second chance at reclamation
# Same shape: 3 segments of 4 blocks of 256 KiB. A record read since its write is copied to the start of its
# reclaimed segment (at most 2 of 4, half a segment) instead of dropped; its read count starts again at 0.
BLK = 256 * KiB


def _bkey(i: int) -> bytes:
    return f"b{i:02d}".encode()


def _write_blocks(s: DiskStore, buf: Buf, ids: range) -> dict[int, bytes]:
    data = {i: random_bytes(BLK, i) for i in ids}
    for i in ids:
        assert write(s, buf, "ns", {_bkey(i): data[i]}) == [OK]
    return data


def _where(s: DiskStore, i: int) -> tuple[int, int]:
    r = s.lookup("ns", _bkey(i))
    assert r is not None
    return r.segment, r.offset // BLK


def test_reclaim_keeps_records_read_since_written_in_offset_order(store: DiskStore) -> None:
    buf = Buf(MiB)
    data = _write_blocks(store, buf, range(12))      # seg0: b00-03  seg1: b04-07  seg2: b08-11
    for i in (2, 1, 2):                      # read b02 twice, b01 once (order of reads does not matter)
        assert read(store, "ns", _bkey(i)) == (OK, data[i])
    seq_before = store.lookup("ns", _bkey(1)).seq   # type: ignore[union-attr]  # the key was just written: lookup finds it
    res = store.write_batch([WriteItem("ns", b"b12", buf.put(data.setdefault(12, random_bytes(BLK, 12))), BLK)])
    # b12 reclaims seg0: b01, b02 are copied to its start (offset order), b00, b03 leave; then b12
    assert res.statuses == [OK] and res.reinserted == 2
    assert res.reclaimed == [("ns", b"b00"), ("ns", b"b03")]
    assert [_where(store, i) for i in (1, 2, 12)] == [(0, 0), (0, 1), (0, 2)]
    assert store.lookup("ns", _bkey(1)).seq > seq_before   # type: ignore[union-attr]  # the key was just written: lookup finds it
    assert store.contains_many("ns", [_bkey(0), _bkey(3)]) == [0, 0]
    st = store.stats()
    assert (st.blocks, st.evicted_blocks, st.reinserted_blocks, st.writes) == (11, 2, 2, 13)
    assert st.bytes_written == (13 + 2) * BLK and st.bytes_read == (3 + 2) * BLK   # the copies are device I/O
    for i in (1, 2, 12):
        assert read(store, "ns", _bkey(i)) == (OK, data[i])
    # b13 fills seg0. b14 reclaims seg1 (b04-07, never read): all go. b15-17 fill seg1, b18 reclaims seg2.
    data.update(_write_blocks(store, buf, range(13, 22)))   # seg1: b14-17  seg2: b18-21
    assert store.contains_many("ns", [_bkey(i) for i in range(4, 12)]) == [0] * 8
    # b22 reclaims seg0 again: b01 b02 b12 were read once since their copy (the reads above), b13 never:
    # only half a segment is kept, the first two in offset order.
    res = store.write_batch([WriteItem("ns", b"b22", buf.put(random_bytes(BLK, 22)), BLK)])
    assert res.reinserted == 2 and res.reclaimed == [("ns", b"b12"), ("ns", b"b13")]
    assert [_where(store, i) for i in (1, 2, 22)] == [(0, 0), (0, 1), (0, 2)]
    # and now b01, b02 have no reads: b23 fills seg0, b24-31 replace seg1 and seg2, b32 reclaims seg0 whole
    res = [store.write_batch([WriteItem("ns", _bkey(i), buf.put(random_bytes(BLK, i)), BLK)]) for i in range(23, 33)]
    assert [r.reinserted for r in res] == [0] * 10
    assert res[-1].reclaimed == [("ns", k) for k in (b"b01", b"b02", b"b22", b"b23")]
    st = store.stats()
    assert (st.evicted_blocks, st.reinserted_blocks) == (2 + 4 + 4 + 2 + 4 + 4 + 4, 4)


def test_reinsert_hits_threshold_and_plain_fifo(tmp_path: Path) -> None:
    for hits, kept in ((2, [2]), (0, [])):
        s = DiskStore(cfg(tmp_path / f"d{hits}", reinsert_hits=hits))
        s.open()
        buf = Buf(MiB)
        _write_blocks(s, buf, range(12))
        for i in (1, 2, 2):
            assert read(s, "ns", _bkey(i))[0] is OK
        res = s.write_batch([WriteItem("ns", b"b12", buf.put(random_bytes(BLK, 12)), BLK)])
        assert res.reinserted == len(kept)
        assert [k for _, k in res.reclaimed] == [_bkey(i) for i in range(4) if i not in kept]
        s.close()
    with pytest.raises(ConfigError, match="reinsert_hits"):
        cfg(tmp_path, reinsert_hits=-1)


def test_a_key_rewritten_by_the_reclaiming_batch_is_not_reported_or_copied(store: DiskStore) -> None:
    buf = Buf(2 * MiB)
    _write_blocks(store, buf, range(12))
    assert read(store, "ns", _bkey(1))[0] is OK
    new = random_bytes(BLK, 99)
    res = store.write_batch([WriteItem("ns", b"b12", buf.put(random_bytes(BLK, 12)), BLK),
                             WriteItem("ns", b"b01", buf.put(new, BLK), BLK)])
    # seg0 reclaimed for b12: b01 is rewritten by this very batch, so its old (read) record is not copied
    assert res.statuses == [OK, OK] and res.reinserted == 0
    assert res.reclaimed == [("ns", b"b00"), ("ns", b"b02"), ("ns", b"b03")]
    assert _where(store, 1) == (0, 1) and read(store, "ns", b"b01") == (OK, new)


def test_a_block_deleted_while_its_record_is_copied_stays_deleted(tmp_path: Path) -> None:
    io = GatedIO()
    s = DiskStore(cfg(tmp_path / "d"), io=io)
    s.open()
    buf = Buf(MiB)
    data = _write_blocks(s, buf, range(12))
    for i in (1, 2):
        assert read(s, "ns", _bkey(i))[0] is OK
    io.armed = "pread"   # the writer's copy of b01 (a pread) waits at the gate
    out: list = []
    t = threading.Thread(target=lambda: out.append(
        s.write_batch([WriteItem("ns", b"b12", buf.put(random_bytes(BLK, 12)), BLK)])))
    t.start()
    assert io.entered.wait(10)
    assert s.contains_many("ns", [_bkey(1), _bkey(2)]) == [BLK, BLK]   # stale entries: still deletable
    assert s.delete("ns", [_bkey(1)]) == 1
    io.armed = ""
    io.gate.set()
    t.join(10)
    res = out[0]
    assert res.statuses == [OK] and res.reinserted == 1   # b02 only: b01's copy found its entry gone
    assert s.contains_many("ns", [_bkey(1)]) == [0] and read(s, "ns", _bkey(2)) == (OK, data[2])
    assert s.stats().reinserted_blocks == 1
    s.close()


@pytest.mark.parametrize("skip", [0, 1])   # 0: the copy of b01 fails; 1: it succeeds, the batch's own pwrite fails
def test_failed_batch_drops_the_copied_records_and_reports_them(tmp_path: Path, skip: int) -> None:
    io = FaultyIO()
    s = DiskStore(cfg(tmp_path / "d"), io=io)
    s.open()
    buf = Buf(MiB)
    _write_blocks(s, buf, range(12))
    assert read(s, "ns", _bkey(1))[0] is OK
    io.inject("pwrite", errno.EIO, skip=skip, times=1)
    res = s.write_batch([WriteItem("ns", b"b12", buf.put(random_bytes(BLK, 12)), BLK)])
    assert res.statuses == [DiskStatus.IO_ERROR] and res.reinserted == 0
    assert sorted(k for _, k in res.reclaimed) == [_bkey(i) for i in range(4)]
    assert s.contains_many("ns", [_bkey(i) for i in range(4)]) == [0] * 4
    assert (s.stats().evicted_blocks, s.stats().reinserted_blocks, s.degraded) == (4, 0, True)
    s.close()


def test_reinserted_records_survive_a_reopen_and_stale_ones_are_dropped(tmp_path: Path) -> None:
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    buf = Buf(MiB)
    data = _write_blocks(s, buf, range(13))     # b12 reclaims seg0, nothing read: b00-03 gone
    assert read(s, "ns", _bkey(4)) == (OK, data[4])
    data.update(_write_blocks(s, buf, range(13, 17)))   # b16 reclaims seg1: b04 is copied to its start
    s.close()
    s = DiskStore(cfg(tmp_path / "d"))
    report = s.open()
    assert (report.blocks, report.dropped_entries) == (10, 0)
    assert _where(s, 4) == (1, 0) and read(s, "ns", _bkey(4)) == (OK, data[4])
    s.close()


def test_batch_larger_than_capacity_gets_no_space_for_the_rest(store: DiskStore) -> None:
    buf = Buf(4 * MiB)
    blocks = {f"k{i}".encode(): random_bytes(512 * KiB, i) for i in range(8)}   # 4 MiB > 3 MiB
    statuses = write(store, buf, "ns", blocks)
    assert statuses == [OK] * 6 + [DiskStatus.NO_SPACE] * 2
    assert not store.degraded
    assert write(store, buf, "ns", {b"after": b"x"}) == [OK]


def test_reopen_keeps_blocks_and_fifo_order(tmp_path: Path) -> None:
    buf = Buf(MiB)
    blk = 256 * KiB
    data = {i: random_bytes(blk, i) for i in range(14)}
    key = lambda i: f"b{i:02d}".encode()  # noqa: E731
    s = DiskStore(cfg(tmp_path / "d", reinsert_hits=0))   # plain FIFO: the reads below give no second chance
    s.open()
    for i in range(13):   # seg0: b00-03 reclaimed by b12; seg1: b04-07; seg2: b08-11; seg0: b12
        assert write(s, buf, "ns", {key(i): data[i]}) == [OK]
    s.close()
    s = DiskStore(cfg(tmp_path / "d", reinsert_hits=0))
    report = s.open()
    assert (report.created, report.blocks, report.dropped_entries, report.segments_in_use) == (False, 9, 0, 3)
    for i in range(4, 13):
        assert read(s, "ns", key(i)) == (OK, data[i])
    for i in (13, 0, 1, 2):   # b13, b00, b01 fill seg 0 (active again); b02 must reclaim seg 1, now the oldest
        assert write(s, buf, "ns", {key(i): data[i]}) == [OK]
    assert s.contains_many("ns", [key(i) for i in range(4, 8)]) == [0] * 4
    assert all(s.contains_many("ns", [key(i) for i in range(8, 14)]))
    s.close()


def test_wipe_empties(tmp_path: Path) -> None:
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    assert write(s, Buf(MiB), "ns", {b"k": b"v"}) == [OK]
    s.close()
    s = DiskStore(cfg(tmp_path / "d"))
    report = s.open(wipe=True)
    assert report.wiped and report.blocks == 0
    assert s.lookup("ns", b"k") is None and s.stats().blocks == 0 and s.namespaces() == []
    s.close()


def test_segment_bytes_mismatch_on_reopen_is_a_clear_error(tmp_path: Path) -> None:
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    s.close()
    other = DiskStore(cfg(tmp_path / "d", segment_bytes=2 * MiB, capacity_bytes=8 * MiB))
    with pytest.raises(ConfigError, match=r"segment_bytes=1048576.*wipe=True"):
        other.open()
    assert other.open(wipe=True).wiped   # the way out the message names
    other.close()


def test_second_open_of_a_directory_is_refused(store: DiskStore, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="in use by another process"):
        DiskStore(cfg(tmp_path / "disk")).open()


def test_lower_capacity_drops_entries_of_removed_segments(tmp_path: Path) -> None:
    s = DiskStore(cfg(tmp_path / "d", capacity_bytes=4 * MiB))
    s.open()
    buf = Buf(MiB)
    for i in range(16):   # 4 segments x 4 blocks
        assert write(s, buf, "ns", {f"b{i:02d}".encode(): random_bytes(256 * KiB, i)}) == [OK]
    s.close()
    s = DiskStore(cfg(tmp_path / "d", capacity_bytes=3 * MiB))
    report = s.open()
    assert (report.blocks, report.dropped_entries, report.removed_files) == (12, 4, 1)
    assert s.contains_many("ns", [b"b12", b"b11"]) == [0, 256 * KiB]
    s.close()
