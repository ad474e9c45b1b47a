"""DiskStore (the disk tier's storage layer) driven against real files in tmp_path: configuration, round trips
of every codec, the index operations, and damage (flipped bytes, truncated segments) that must read as an error,
never as bytes.

Shapes used throughout (tests/disk_store_helpers.py): segments of 1 MiB (the smallest allowed), so a few blocks
of 256 KiB fill a segment; capacity 3 segments. Source and destination buffers are page-aligned anonymous mmaps,
as arena slots are. Reclamation and reopen: test_disk_store_reclaim.py; I/O faults and real filesystems:
test_disk_store_faults.py; a SIGKILL mid-write and concurrent readers: test_disk_store_races.py.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import xxhash

from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.tiers.disk import DiskStatus, DiskStore, WriteItem
from kvstore.tiers.disk.codec import shuffle2, unshuffle2_into
from tests.disk_store_helpers import (
    NOT_FOUND, OK, PAGE, Buf, KiB, MiB, bf16_like, cfg, flip_byte, random_bytes, read, store_fixture, write,
)

store = store_fixture()


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


# ----------------------------------------------------------------------------------- corruption / damage
@pytest.mark.parametrize("codec", ["none", "zstd-shuffle2"])
def test_flipped_bytes_give_checksum_error_never_bytes(store: DiskStore, codec: str) -> None:
    data = bf16_like(100 * KiB, 5)
    assert write(store, Buf(MiB), "ns", {b"k": data, b"ok": data}, codec) == [OK, OK]
    rec = store.lookup("ns", b"k")
    assert rec is not None and rec.codec == codec
    flip_byte(store.segment_path(rec.segment), rec.offset + rec.stored_length // 2, 0x5A)
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
