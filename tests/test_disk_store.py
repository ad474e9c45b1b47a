"""DiskStore (the disk tier's storage layer) driven against real files in tmp_path.

Shapes used throughout: segments of 1 MiB (the smallest allowed), so a few blocks of 256 KiB fill a segment and
FIFO reclamation can be read off the comments: 4 blocks of 256 KiB per segment, capacity 3 segments.
Fault tests use FaultyIO (a real BlockIO that raises a chosen errno) and, as root, a real 8 MiB tmpfs for
ENOSPC and a read-only remount. Source and destination buffers are page-aligned anonymous mmaps, as arena
slots are.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.testing.gated_io import GatedIO
from kvstore.tiers.disk import DiskConfig, DiskStatus, DiskStore, FaultyIO, WriteItem
from kvstore.tiers.disk.codec import shuffle2, unshuffle2_into

KiB = 1024
MiB = 1024 * KiB
PAGE = 4096
OK, NOT_FOUND = DiskStatus.OK, DiskStatus.NOT_FOUND
LOGGER = "kvstore.tiers.disk"


# ------------------------------------------------------------------------------------------------ helpers
class Buf:
    """Page-aligned memory (an anonymous mmap, as an arena slot) with a numpy view and its raw address."""

    def __init__(self, size: int) -> None:
        self.size = -(-size // PAGE) * PAGE
        self.mm = mmap.mmap(-1, self.size)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = self.arr.ctypes.data
        assert self.address % PAGE == 0

    def put(self, data: bytes, at: int = 0) -> int:
        self.arr[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
        return self.address + at

    def get(self, n: int, at: int = 0) -> bytes:
        return self.arr[at:at + n].tobytes()


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def bf16_like(n: int, seed: int) -> bytes:
    """bf16 KV-like data: the high halves of normal float32s (repetitive high bytes, noisy low bytes)."""
    f = np.random.default_rng(seed).standard_normal(-(-n // 2), dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()[:n]


def cfg(directory: Path, **kw: object) -> DiskConfig:
    opts: dict = {"capacity_bytes": 3 * MiB, "segment_bytes": 1 * MiB, "sync": "none"}
    opts.update(kw)
    return DiskConfig(str(directory), **opts)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskStore]:
    s = DiskStore(cfg(tmp_path / "disk"))
    s.open()
    yield s
    s.close()


def write(
    store: DiskStore, buf: Buf, ns: str, blocks: dict[bytes, bytes], codec: str | None = None
) -> list[DiskStatus]:
    """One batch: every block copied into `buf` back to back (page-aligned), then write_many."""
    items, at = [], 0
    for key, data in blocks.items():
        items.append(WriteItem(ns, key, buf.put(data, at), len(data), codec))
        at += -(-len(data) // PAGE) * PAGE
    return store.write_many(items)


def read(store: DiskStore, ns: str, key: bytes, size: int = 2 * MiB) -> tuple[DiskStatus, bytes]:
    out = Buf(size)
    out.arr[:] = 0xAB
    status, n = store.read_into(ns, key, out.address, out.size)
    return status, out.get(n)


def disk_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(LOGGER) and r.levelno >= logging.ERROR]


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kw", "hint"),
    [
        ({"segment_bytes": 3 * MiB // 2}, "multiple of 1 MiB"),
        ({"capacity_bytes": MiB}, "at least 2097152"),
        ({"sync": "always"}, "crash-safe"),
        ({"compression": "lz4"}, "zstd-shuffle2"),
        ({"probe_interval_s": 0}, "positive number"),
    ],
)
def test_config_rejects_bad_values_with_a_fix(tmp_path: Path, kw: dict, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint):
        cfg(tmp_path, **kw)


def test_shuffle2_groups_low_and_high_bytes() -> None:
    src = memoryview(bytes([0xA0, 0xA1, 0xB0, 0xB1, 0xC0, 0xC1, 0xFF]))
    shuffled = shuffle2(src)
    assert shuffled.tobytes() == bytes([0xA0, 0xB0, 0xC0, 0xA1, 0xB1, 0xC1, 0xFF])
    back = bytearray(len(src))
    unshuffle2_into(shuffled, memoryview(back))
    assert bytes(back) == bytes(src)


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("codec", ["none", "zstd", "zstd-shuffle2"])
def test_round_trip_sizes_1B_to_2MiB(tmp_path: Path, codec: str) -> None:
    s = DiskStore(cfg(tmp_path / "d", capacity_bytes=16 * MiB, segment_bytes=4 * MiB, compression=codec))
    s.open()
    rng = random.Random(7)
    sizes = [1, 2, 3, 100, 4095, 4096, 4097, 65539, MiB, 2 * MiB] + [rng.randint(1, 2 * MiB) for _ in range(6)]
    blocks = {
        f"k{i}".encode(): (bf16_like if i % 2 else random_bytes)(n, i) for i, n in enumerate(sizes)
    }
    buf = Buf(4 * MiB)
    for key, data in blocks.items():   # one block per batch: 2 MiB blocks, 4 MiB segments
        assert write(s, buf, "ns", {key: data}) == [OK]
    for key, data in blocks.items():
        assert read(s, "ns", key) == (OK, data), key
    lengths = s.contains_many("ns", [*blocks, b"absent"])
    assert lengths == [len(d) for d in blocks.values()] + [0]
    rec = s.lookup("ns", b"k9")
    assert rec is not None and rec.length == 2 * MiB and rec.offset % PAGE == 0
    assert rec.checksum == xxhash.xxh3_64_intdigest(blocks[b"k9"])
    st = s.stats()
    assert st.writes == len(blocks) and st.reads == len(blocks) and st.checksum_failures == 0
    assert st.blocks == len(blocks) and st.direct_io
    s.close()


def test_compression_ratio_and_shuffle_gain(tmp_path: Path) -> None:
    data = bf16_like(2 * MiB, 1)
    ratios = {}
    for codec in ("zstd", "zstd-shuffle2"):
        s = DiskStore(cfg(tmp_path / codec, capacity_bytes=8 * MiB, segment_bytes=4 * MiB))
        s.open()
        assert write(s, Buf(2 * MiB), "ns", {b"kv": data}, codec) == [OK]
        assert read(s, "ns", b"kv") == (OK, data)
        rec = s.lookup("ns", b"kv")
        assert rec is not None and rec.codec == codec and rec.stored_length < rec.length
        st = s.stats()
        assert st.raw_bytes == 2 * MiB and st.stored_bytes == rec.stored_length
        ratios[codec] = st.compression_ratio
        s.close()
    assert ratios["zstd"] > 1.0
    assert ratios["zstd-shuffle2"] > ratios["zstd"]


def test_incompressible_block_is_stored_raw(store: DiskStore) -> None:
    data = random_bytes(300 * KiB, 3)
    assert write(store, Buf(MiB), "ns", {b"r": data}, "zstd") == [OK]
    rec = store.lookup("ns", b"r")
    assert rec is not None and rec.codec == "none" and rec.stored_length == len(data)
    assert read(store, "ns", b"r") == (OK, data)


def test_read_into_short_capacity_uses_a_bounce_and_too_small_raises(store: DiskStore) -> None:
    data = random_bytes(5000, 4)   # footprint 8192
    assert write(store, Buf(8192), "ns", {b"k": data}) == [OK]
    out = Buf(8192)
    assert store.read_into("ns", b"k", out.address, 5000) == (OK, 5000)   # not a whole page: bounce buffer
    assert out.get(5000) == data
    with pytest.raises(InvalidRequestError, match="at least 8192"):
        store.read_into("ns", b"k", out.address, 4999)


def test_replace_key_gets_new_seq_and_frees_old_space(store: DiskStore) -> None:
    buf = Buf(MiB)
    assert write(store, buf, "ns", {b"k": random_bytes(8192, 1)}) == [OK]
    first = store.lookup("ns", b"k")
    new = random_bytes(12288, 2)
    assert write(store, buf, "ns", {b"k": new}) == [OK]
    second = store.lookup("ns", b"k")
    assert first is not None and second is not None
    assert second.seq > first.seq and second.offset == first.offset + 8192
    assert read(store, "ns", b"k") == (OK, new)
    st = store.stats()
    assert (st.blocks, st.used_bytes, st.writes) == (1, 12288, 2)


def test_delete_clear_namespace_and_namespaces(store: DiskStore) -> None:
    buf = Buf(MiB)
    blocks = {f"k{i}".encode(): random_bytes(4096, i) for i in range(6)}
    assert write(store, buf, "a", blocks) == [OK] * 6
    assert write(store, buf, "b", {b"k0": b"x" * 10}) == [OK]
    assert store.namespaces() == ["a", "b"]
    assert store.delete("a", [b"k0", b"k1", b"nope"]) == 2
    assert read(store, "a", b"k0")[0] is NOT_FOUND
    assert store.contains_many("a", [b"k0", b"k2"]) == [0, 4096]
    assert store.clear_namespace("a") == 4
    assert store.contains_many("a", list(blocks)) == [0] * 6
    assert store.namespaces() == ["b"]
    assert read(store, "b", b"k0") == (OK, b"x" * 10)   # other namespace untouched
    assert store.delete("unknown", [b"k"]) == 0 and store.clear_namespace("unknown") == 0
    assert store.stats().blocks == 1


def test_list_keys_pagination(store: DiskStore) -> None:
    keys = [f"key-{i:03d}".encode() for i in range(25)]
    assert write(store, Buf(MiB), "ns", {k: b"v" * (i + 1) for i, k in enumerate(keys)}) == [OK] * 25
    seen, cursor, pages = [], b"", 0
    while True:
        records, cursor = store.list_keys("ns", cursor, 10)
        seen += [r.key for r in records]
        pages += 1
        if not cursor:
            break
    assert seen == keys and pages == 3
    records, _ = store.list_keys("ns", b"key-004", 2)
    assert [(r.key, r.length) for r in records] == [(b"key-005", 6), (b"key-006", 7)]
    assert store.list_keys("other", b"", 10) == ([], b"")


def test_invalid_requests_raise(store: DiskStore) -> None:
    buf = Buf(2 * MiB)
    with pytest.raises(InvalidRequestError, match="page-aligned"):
        store.write_many([WriteItem("ns", b"k", buf.address + 8, 10)])
    with pytest.raises(InvalidRequestError, match="one segment"):
        store.write_many([WriteItem("ns", b"k", buf.address, MiB + 1)])
    with pytest.raises(InvalidRequestError, match="once per batch"):
        store.write_many([WriteItem("ns", b"k", buf.address, 1), WriteItem("ns", b"k", buf.address, 1)])
    with pytest.raises(InvalidRequestError, match="codec"):
        store.write_many([WriteItem("ns", b"k", buf.address, 1, "gzip")])
    assert store.write_many([]) == []


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
    assert store.lookup("ns", key(5)).segment == 0                               # type: ignore[union-attr]
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
    seq_before = store.lookup("ns", _bkey(1)).seq   # type: ignore[union-attr]
    res = store.write_batch([WriteItem("ns", b"b12", buf.put(data.setdefault(12, random_bytes(BLK, 12))), BLK)])
    # b12 reclaims seg0: b01, b02 are copied to its start (offset order), b00, b03 leave; then b12
    assert res.statuses == [OK] and res.reinserted == 2
    assert res.reclaimed == [("ns", b"b00"), ("ns", b"b03")]
    assert [_where(store, i) for i in (1, 2, 12)] == [(0, 0), (0, 1), (0, 2)]
    assert store.lookup("ns", _bkey(1)).seq > seq_before   # type: ignore[union-attr]
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


# ----------------------------------------------------------------------------------- corruption / damage
@pytest.mark.parametrize("codec", ["none", "zstd-shuffle2"])
def test_flipped_bytes_give_checksum_error_never_bytes(store: DiskStore, codec: str) -> None:
    data = bf16_like(100 * KiB, 5)
    assert write(store, Buf(MiB), "ns", {b"k": data, b"ok": data}, codec) == [OK, OK]
    rec = store.lookup("ns", b"k")
    assert rec is not None and rec.codec == codec
    with open(store.segment_path(rec.segment), "r+b") as f:
        f.seek(rec.offset + rec.stored_length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
    out = Buf(MiB)
    out.arr[:] = 0xAB
    assert store.read_into("ns", b"k", out.address, out.size) == (DiskStatus.CHECKSUM_ERROR, 0)
    assert out.get(len(data)) == bytes(len(data))    # the destination was scrubbed, not left with bad bytes
    assert store.stats().checksum_failures == 1
    assert store.lookup("ns", b"k") is None           # entry dropped
    assert read(store, "ns", b"k")[0] is NOT_FOUND
    assert read(store, "ns", b"ok") == (OK, data)


def test_truncated_segment_drops_entries_at_open(tmp_path: Path) -> None:
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    blocks = {f"k{i}".encode(): random_bytes(100 * KiB + 1000, i) for i in range(6)}   # footprint 104 KiB each
    assert write(s, Buf(MiB), "ns", blocks) == [OK] * 6
    path = s.segment_path(0)
    s.close()
    os.truncate(path, 3 * 104 * KiB + 50 * KiB)   # k0-k2 intact, k3 cut in the middle, k4-k5 gone
    s = DiskStore(cfg(tmp_path / "d"))
    report = s.open()
    assert (report.blocks, report.dropped_entries) == (3, 3) and s.stats().dropped_entries == 3
    for i in range(3):
        assert read(s, "ns", f"k{i}".encode()) == (OK, blocks[f"k{i}".encode()])
    for i in range(3, 6):
        assert read(s, "ns", f"k{i}".encode())[0] is NOT_FOUND
    assert write(s, Buf(MiB), "ns", {b"new": b"n" * 5000}) == [OK]   # appends after k2, re-extends the file
    assert read(s, "ns", b"new") == (OK, b"n" * 5000)
    s.close()


def test_truncated_segment_while_open_is_io_error_not_bytes(store: DiskStore) -> None:
    blocks = {f"k{i}".encode(): random_bytes(100 * KiB + 1000, i) for i in range(4)}   # footprint 104 KiB
    assert write(store, Buf(MiB), "ns", blocks) == [OK] * 4
    os.truncate(store.segment_path(0), 2 * 104 * KiB)
    assert read(store, "ns", b"k3")[0] is DiskStatus.IO_ERROR
    assert store.lookup("ns", b"k3") is None and store.stats().io_errors == 1
    assert read(store, "ns", b"k1") == (OK, blocks[b"k1"])
    assert not store.degraded


# ------------------------------------------------------------------------------------------------ faults
@pytest.mark.parametrize(
    ("err", "status"),
    [(errno.EIO, DiskStatus.IO_ERROR), (errno.EROFS, DiskStatus.IO_ERROR), (errno.EACCES, DiskStatus.IO_ERROR),
     (errno.ENOSPC, DiskStatus.NO_SPACE)],
)
def test_write_fault_degrades_logs_once_and_probe_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, err: int, status: DiskStatus
) -> None:
    io = FaultyIO()
    s = DiskStore(cfg(tmp_path / "d"), io=io)
    s.open()
    buf = Buf(MiB)
    assert write(s, buf, "ns", {b"before": b"b" * 10}) == [OK]
    caplog.set_level(logging.INFO, logger=LOGGER)
    io.inject("pwrite", err)
    assert write(s, buf, "ns", {b"k1": b"1" * 10, b"k2": b"2" * 10}) == [status, status]
    assert s.degraded and os.strerror(err) in s.stats().degraded_reason
    pwrites = io.calls["pwrite"]
    for _ in range(5):   # refused without I/O, and without more log lines
        assert write(s, buf, "ns", {b"k3": b"3"}) == [DiskStatus.DEGRADED]
    assert io.calls["pwrite"] == pwrites
    assert read(s, "ns", b"before") == (OK, b"b" * 10)      # reads still work
    assert s.probe() is False and s.degraded                # the fault is still there
    errors = disk_errors(caplog)
    assert len(errors) == 1 and str(tmp_path / "d") in errors[0].getMessage()
    io.clear()
    assert s.probe() is True and not s.degraded
    assert write(s, buf, "ns", {b"k1": b"1" * 10}) == [OK]
    assert read(s, "ns", b"k1") == (OK, b"1" * 10)
    assert len(disk_errors(caplog)) == 1
    assert any("recovered" in r.getMessage() for r in caplog.records)
    s.close()


@pytest.mark.parametrize("op", ["fdatasync", "fallocate"])
def test_sync_and_preallocation_faults_degrade_too(tmp_path: Path, op: str) -> None:
    io = FaultyIO()
    s = DiskStore(cfg(tmp_path / "d", sync="data"), io=io)
    s.open()
    io.inject(op, errno.EIO, times=1)
    assert write(s, Buf(MiB), "ns", {b"k": b"v"}) == [DiskStatus.IO_ERROR]
    assert s.lookup("ns", b"k") is None and s.degraded
    assert s.probe() and write(s, Buf(MiB), "ns", {b"k": b"v"}) == [OK]
    s.close()


def test_read_eio_drops_entry_and_does_not_degrade(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    io = FaultyIO()
    s = DiskStore(cfg(tmp_path / "d"), io=io)
    s.open()
    assert write(s, Buf(MiB), "ns", {b"a": b"a" * 100, b"b": b"b" * 100}) == [OK, OK]
    io.inject("pread", errno.EIO, times=1)
    assert read(s, "ns", b"a")[0] is DiskStatus.IO_ERROR
    st = s.stats()
    assert st.io_errors == 1 and not st.degraded and s.lookup("ns", b"a") is None
    assert read(s, "ns", b"b") == (OK, b"b" * 100)
    assert len(disk_errors(caplog)) == 1
    s.close()


def test_fallback_to_buffered_io_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr("kvstore.tiers.disk.io.os.open", no_direct)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    data = {f"k{i}".encode(): random_bytes(300 * KiB, i) for i in range(6)}   # spans 2 segment files
    assert write(s, Buf(2 * MiB), "ns", data) == [OK] * 6
    for k, v in data.items():
        assert read(s, "ns", k) == (OK, v)
    assert not s.stats().direct_io
    assert len([r for r in caplog.records if "O_DIRECT" in r.getMessage()]) == 1
    s.close()


# ---------------------------------------------------------------------------------- real filesystems
@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A private 8 MiB tmpfs (real ENOSPC, real read-only remount)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a private tmpfs (real ENOSPC and read-only filesystem tests)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(path: Path, leave: int) -> None:
    """A filler file taking all but about `leave` bytes of its filesystem."""
    st = os.statvfs(path.parent)
    size = st.f_bavail * st.f_frsize - leave
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, size)


def test_enospc_on_a_full_tmpfs_then_recovery(tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    # store of 16 MiB on an 8 MiB filesystem: segments of 2 MiB are preallocated as they are first used
    s = DiskStore(DiskConfig(str(tmpfs / "store"), capacity_bytes=16 * MiB, segment_bytes=2 * MiB, sync="data"))
    s.open()
    buf = Buf(2 * MiB)
    blocks = {f"k{i}".encode(): random_bytes(512 * KiB, i) for i in range(4)}
    assert write(s, buf, "ns", blocks) == [OK] * 4                      # segment 0, preallocated at first use
    _fill(tmpfs / "filler", leave=MiB)                                  # segment 1 (2 MiB) cannot be allocated
    assert write(s, buf, "ns", {b"more": random_bytes(512 * KiB, 9)}) == [DiskStatus.NO_SPACE]
    assert s.degraded and "No space left" in s.stats().degraded_reason
    assert write(s, buf, "ns", {b"more": b"x"}) == [DiskStatus.DEGRADED]
    assert read(s, "ns", b"k2") == (OK, blocks[b"k2"])                  # reads still served
    assert s.probe() is False
    assert len(disk_errors(caplog)) == 1
    os.unlink(tmpfs / "filler")
    assert s.probe() is True and not s.degraded
    assert write(s, buf, "ns", {b"more": blocks[b"k1"]}) == [OK]
    assert read(s, "ns", b"more") == (OK, blocks[b"k1"])
    s.close()


def test_read_only_filesystem_then_remount_rw(tmpfs: Path) -> None:
    # Linux refuses `remount,ro` while files are open for writing (EBUSY), so the store is closed first; a live
    # store meeting EROFS (a kernel remount after errors) is covered by the FaultyIO EROFS case above.
    conf = DiskConfig(str(tmpfs / "store"), capacity_bytes=4 * MiB, segment_bytes=MiB, sync="data")
    s = DiskStore(conf)
    s.open()
    assert write(s, Buf(MiB), "ns", {b"k": b"kept" * 1000}) == [OK]
    s.close()
    r = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    s = DiskStore(conf)
    report = s.open()
    assert report.read_only and s.degraded and report.blocks == 1
    assert read(s, "ns", b"k") == (OK, b"kept" * 1000)
    assert write(s, Buf(MiB), "ns", {b"n": b"new"}) == [DiskStatus.DEGRADED]
    assert s.delete("ns", [b"k"]) == 0
    assert s.probe() is False
    subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    assert s.probe() is True and not s.degraded
    assert write(s, Buf(MiB), "ns", {b"n": b"new"}) == [OK]
    assert read(s, "ns", b"n") == (OK, b"new") and read(s, "ns", b"k") == (OK, b"kept" * 1000)
    s.close()


# ------------------------------------------------------------------------------------------- crash safety
CONTENT_SRC = '''
import numpy as np, xxhash
def content(key):
    h = xxhash.xxh64_intdigest(key)
    n = 1 + h % (200 << 10)
    rng = np.random.default_rng(h)
    if h % 3 == 0:
        return rng.bytes(n)
    return (rng.integers(0, 16, n, dtype=np.uint8) * 3).tobytes()
def codec_for(key):
    return ("none", "zstd", "zstd-shuffle2")[xxhash.xxh64_intdigest(key, seed=1) % 3]
'''
_ns: dict = {}
exec(CONTENT_SRC, _ns)
content, codec_for = _ns["content"], _ns["codec_for"]

CHILD = CONTENT_SRC + '''
import mmap, sys
from kvstore.tiers.disk import DiskConfig, DiskStore, WriteItem
directory, rnd = sys.argv[1], int(sys.argv[2])
store = DiskStore(DiskConfig(directory, capacity_bytes=6 << 20, segment_bytes=1 << 20, sync="data"))
store.open()
mm = mmap.mmap(-1, 8 * (256 << 10))
arr = np.frombuffer(mm, dtype=np.uint8)
print("ready", flush=True)
i = batch = 0
while True:
    n = 1 + batch % 6
    keys = [b"r%d-%d" % (rnd, i + j) for j in range(n)]
    if batch % 5 == 4:
        keys.append(b"r%d-%d" % (rnd, i // 2))      # replace an earlier key (same bytes)
    i += n
    batch += 1
    items = []
    for j, key in enumerate(keys):
        data = content(key)
        off = j * (256 << 10)
        arr[off:off + len(data)] = np.frombuffer(data, dtype=np.uint8)
        items.append(WriteItem("crash", key, arr.ctypes.data + off, len(data), codec_for(key)))
    store.write_many(items)
'''


def test_sigkill_during_write_storm_never_serves_torn_blocks(tmp_path: Path) -> None:
    directory = tmp_path / "crash"
    rng = random.Random(11)
    for rnd in range(3):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(rnd)], stdout=subprocess.PIPE)
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.3, 1.2))
        child.send_signal(signal.SIGKILL)
        child.wait()
        s = DiskStore(DiskConfig(str(directory), capacity_bytes=6 << 20, segment_bytes=1 << 20, sync="data"))
        s.open()
        seen, cursor = [], b""
        while True:
            records, cursor = s.list_keys("crash", cursor, 100)
            seen += records
            if not cursor:
                break
        assert any(r.key.startswith(b"r%d-" % rnd) for r in seen), "the child committed nothing"
        out = Buf(256 * KiB)
        for rec in seen:
            status, n = s.read_into("crash", rec.key, out.address, out.size)
            assert status is OK, (rnd, rec)
            assert out.get(n) == content(rec.key), (rnd, rec)
        assert s.stats().checksum_failures == 0
        s.close()


# ------------------------------------------------------------------------------------------- concurrency
def test_reads_racing_reclamation_are_misses_never_wrong_bytes(tmp_path: Path) -> None:
    # 3 segments of 1 MiB, 64 KiB blocks: a segment is reclaimed every 16 writes while readers read.
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    blk = 64 * KiB
    written: list[bytes] = []
    stop = threading.Event()
    bad: list[object] = []
    counts = {"ok": 0, "miss": 0}

    def data_of(key: bytes) -> bytes:
        return random_bytes(blk, xxhash.xxh64_intdigest(key))

    def writer() -> None:
        buf = Buf(4 * blk)
        i = 0
        while not stop.is_set():
            batch = {f"w{i + j}".encode(): b"" for j in range(4)}
            for key in batch:
                batch[key] = data_of(key)
            if write(s, buf, "ns", batch) != [OK] * 4:
                bad.append(("write", i))
            written.extend(batch)
            i += 4

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        out = Buf(blk)
        while not stop.is_set():
            if len(written) < 8:
                continue
            key = written[rnd.randrange(max(0, len(written) - 60), len(written))]
            status, n = s.read_into("ns", key, out.address, out.size)
            if status is OK:
                counts["ok"] += 1
                if out.get(n) != data_of(key):
                    bad.append(("bytes", key))
            elif status is NOT_FOUND:
                counts["miss"] += 1
            else:
                bad.append((status, key))

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join()
    st = s.stats()
    s.close()
    assert not bad, bad[:5]
    assert counts["ok"] > 50 and st.evicted_blocks > 0 and st.checksum_failures == 0


@pytest.mark.parametrize("corrupt", [False, True])
def test_close_waits_for_in_flight_reads(tmp_path: Path, corrupt: bool) -> None:
    io = GatedIO()
    s = DiskStore(cfg(tmp_path / "d"), io=io)
    s.open()
    data = random_bytes(64 * KiB, 1)
    assert write(s, Buf(MiB), "ns", {b"k": data}) == [OK]
    if corrupt:   # the read then drops the entry, which needs the index: close must not hold it while waiting
        rec = s.lookup("ns", b"k")
        assert rec is not None
        with open(s.segment_path(rec.segment), "r+b") as f:
            f.seek(rec.offset)
            f.write(b"\0" * 16)
    io.armed = "pread"
    result: list[tuple[DiskStatus, bytes]] = []
    reader = threading.Thread(target=lambda: result.append(read(s, "ns", b"k")))
    reader.start()
    assert io.entered.wait(10)                 # the read is inside its pread
    closer = threading.Thread(target=s.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()                   # close waits for the read in flight
    io.gate.set()
    reader.join(10)
    closer.join(10)
    assert not closer.is_alive() and not reader.is_alive()
    assert result == [(DiskStatus.CHECKSUM_ERROR, b"")] if corrupt else result == [(OK, data)]
    assert read(s, "ns", b"k")[0] is NOT_FOUND   # a closed store answers reads with a miss


def test_corrupt_zstd_header_is_a_checksum_error(store: DiskStore) -> None:
    data = bf16_like(64 * KiB, 8)
    assert write(store, Buf(MiB), "ns", {b"z": data}, "zstd") == [OK]
    rec = store.lookup("ns", b"z")
    assert rec is not None and rec.codec == "zstd"
    with open(store.segment_path(rec.segment), "r+b") as f:   # the frame header: magic, descriptor, size
        f.seek(rec.offset)
        f.write(b"\xff" * 12)
    assert read(store, "ns", b"z") == (DiskStatus.CHECKSUM_ERROR, b"")
    assert store.stats().checksum_failures == 1 and store.lookup("ns", b"z") is None
