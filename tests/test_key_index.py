"""The shared key index's table (kvstore/_native/key_index.c through kvstore/fastpath/key_index.py), alone.

Against a dict model under random inserts and removals (collisions forced by a small table, so the backward
shift of a removal is exercised), the 3/4 fill limit, namespaces kept apart, prefix answers, bad arguments, the
read-only descriptor a client gets, and the sequence lock: a reader racing a writer in another process never
sees an entry that was not there (a wrong id or serial), only a retry or a right answer.
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import os
import random
import struct
import time

import numpy as np
import pytest

import kvstore._native._keyindex as native
from kvstore.fastpath.key_index import HEADER, IndexTable, IndexView, capacity_for


ZEROS = ([0, 0, 0], [0, 0, 0], [0, 0, 0])  # sizes, offsets, checksums of three keys


def keyset(tag: str, n: int, size: int = 16) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=size).digest() for i in range(n)]


def u32s(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


@pytest.fixture
def table():
    t = IndexTable("test", 64, incarnation=42)
    yield t
    t.close()


def lookup_one(view: IndexView, ns: str, key: bytes) -> tuple[int, int] | None:
    got = view.probe(ns, [key])
    assert got is not None
    n, ids, serials = got
    return (u32s(ids)[0], u32s(serials)[0]) if n else None


def entry_of(view: IndexView, ns: str, key: bytes) -> tuple[int, ...] | None:
    """Every column the table holds for `key`: (id, serial, size, offset, checksum)."""
    got = view.entries(ns, [key])
    assert got is not None and view.unchanged(got.seq)
    if not got.n:
        return None
    return (u32s(got.ids)[0], u32s(got.serials)[0], int(got.sizes[0]), int(got.offsets[0]), int(got.checksums[0]))


def test_random_inserts_and_removals_match_a_dict(table: IndexTable) -> None:
    """Every column of every entry survives the backward shifts of removals around it."""
    view = IndexView(table.reader_fd())
    assert (view.capacity, view.incarnation, view.count) == (64, 42, 0)
    rnd = random.Random(7)
    universe = keyset("u", 120)
    model: dict[bytes, tuple[int, ...]] = {}
    for step in range(3000):
        key = rnd.choice(universe)
        if rnd.random() < 0.55 and key not in model and len(model) < 48:
            entry = (rnd.randrange(1 << 32), rnd.randrange(1 << 32), rnd.randrange(1 << 40), rnd.randrange(1 << 64),
                     rnd.randrange(1 << 64))
            assert table.insert("ns", [key], *([v] for v in entry)) == 1
            model[key] = entry
        elif key in model:
            assert table.remove("ns", [key]) == 1
            del model[key]
        else:
            assert table.remove("ns", [key]) == 0  # not indexed: nothing to remove
        if step % 50 == 0 or len(model) >= 47:
            for k in universe:  # every key, present or not, answers exactly
                assert entry_of(view, "ns", k) == model.get(k), (step, k.hex())
                assert lookup_one(view, "ns", k) == (model[k][:2] if k in model else None)
            assert table.count == view.count == len(model)


def test_a_table_fills_to_three_quarters_then_skips(table: IndexTable) -> None:
    keys = keyset("full", 60)
    assert table.insert("ns", keys, list(range(60)), [1] * 60) == 48
    assert table.count == 48
    view = IndexView(table.reader_fd())
    found = [k for k in keys if lookup_one(view, "ns", k) is not None]
    assert len(found) == 48 and found == keys[:48]
    # an indexed key is updated in place even when the table is full
    assert table.insert("ns", keys[:1], [999], [5]) == 1
    assert lookup_one(view, "ns", keys[0]) == (999, 5)
    assert table.remove("ns", keys[:10]) == 10 and table.count == 38
    assert table.insert("ns", keys[48:58], list(range(48, 58)), [1] * 10) == 10


def test_entries_answer_the_leading_keys_columns_and_the_sequence_says_when_they_may_have_changed(
        table: IndexTable) -> None:
    keys = keyset("cols", 6)
    table.insert("ns", keys[:5], [1, 2, 3, 4, 5], [9] * 5, [4096 * i for i in range(1, 6)],
                 [1 << 20 + i for i in range(5)], [0xABC0 + i for i in range(5)])
    view = IndexView(table.reader_fd())
    got = view.entries("ns", keys[:2] + keys[5:] + keys[2:5])  # a prefix: stops at the key never indexed
    assert got is not None and got.n == 2 and u32s(got.ids) == [1, 2] and u32s(got.serials) == [9, 9]
    assert (got.sizes.tolist(), got.offsets.tolist(), got.checksums.tolist()) == (
        [4096, 8192], [1 << 20, 1 << 21], [0xABC0, 0xABC1])
    assert view.entries("ns", []).n == 0 and view.unchanged(got.seq)
    table.remove("ns", keys[4:5])  # any write moves the sequence, even of keys the batch did not read
    assert not view.unchanged(got.seq)
    again = view.entries("ns", keys[:5])
    assert again.n == 4 and again.seq == got.seq + 2 and view.unchanged(again.seq)


def test_namespaces_and_key_boundaries_are_kept_apart(table: IndexTable) -> None:
    table.insert("ab", [b"c"], [1], [1])
    table.insert("a", [b"bc"], [2], [2])
    table.insert("ns", [b"k" * 40], [3], [3])
    view = IndexView(table.reader_fd())
    assert lookup_one(view, "ab", b"c") == (1, 1)
    assert lookup_one(view, "a", b"bc") == (2, 2)
    assert lookup_one(view, "a", b"c") is None and lookup_one(view, "ab", b"bc") is None
    assert lookup_one(view, "ns", b"k" * 40) == (3, 3)
    assert lookup_one(view, "ns", b"k" * 39) is None and lookup_one(view, "ns", b"k" * 40 + b"\0") is None
    assert lookup_one(view, "other", b"k" * 40) is None


def test_a_probe_answers_the_leading_indexed_keys_with_their_ids(table: IndexTable) -> None:
    keys = keyset("chain", 10)
    table.insert("ns", keys[:4] + keys[5:], [10 + i for i in range(10) if i != 4], [i for i in range(10) if i != 4])
    view = IndexView(table.reader_fd())
    n, ids, serials = view.probe("ns", keys)
    assert (n, u32s(ids), u32s(serials)) == (4, [10, 11, 12, 13], [0, 1, 2, 3])
    assert view.probe("ns", keys[5:]) == (5, struct.pack("<5I", 15, 16, 17, 18, 19), struct.pack("<5I", 5, 6, 7, 8, 9))
    assert view.probe("ns", []) == (0, b"", b"")
    assert view.probe("ns", keys[4:]) == (0, b"", b"")


def test_bad_arguments_are_refused_and_change_nothing(table: IndexTable) -> None:
    mm = table._mm
    keys = keyset("bad", 3)
    with pytest.raises(ValueError, match="not a power of two"):
        native.insert(mm, 48, "ns", keys, [1, 2, 3], [1, 2, 3], *ZEROS)
    with pytest.raises(ValueError, match="needs"):
        native.insert(mm, 128, "ns", keys, [1, 2, 3], [1, 2, 3], *ZEROS)
    with pytest.raises(TypeError, match="keys\\[1\\] is not bytes"):
        native.insert(mm, 64, "ns", [keys[0], "text", keys[2]], [1, 2, 3], [1, 2, 3], *ZEROS)
    with pytest.raises(ValueError, match="as long as keys"):
        native.insert(mm, 64, "ns", keys, [1, 2], [1, 2, 3], *ZEROS)
    with pytest.raises(ValueError, match="32 bits"):
        native.insert(mm, 64, "ns", keys, [1, 2, 1 << 32], [1, 2, 3], *ZEROS)
    with pytest.raises(OverflowError):
        native.insert(mm, 64, "ns", keys, [1, -2, 3], [1, 2, 3], *ZEROS)
    with pytest.raises(ValueError, match="sizes must be a list as long as keys"):
        native.insert(mm, 64, "ns", keys, [1, 2, 3], [1, 2, 3], [0], [0, 0, 0], [0, 0, 0])
    with pytest.raises(OverflowError):
        native.insert(mm, 64, "ns", keys, [1, 2, 3], [1, 2, 3], [0, 0, 0], [0, 1 << 64, 0], [0, 0, 0])
    with pytest.raises(TypeError, match="list of bytes"):
        native.remove(mm, 64, "ns", tuple(keys))
    assert table.count == 0 and HEADER.unpack_from(mm, 0)[2] == 0  # nothing written: not even the sequence moved
    view = IndexView(table.reader_fd())
    with pytest.raises(TypeError, match="read-write"):  # a client's mapping cannot be written, even by this module
        native.insert(view._mm, 64, "ns", keys, [1, 2, 3], [1, 2, 3], *ZEROS)
    with pytest.raises(TypeError):
        view.probe("ns", [b"ok", 7])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="bad magic"):
        native.probe(bytes(4096), "ns", keys)
    with pytest.raises(ValueError, match="capacity 0"):
        native.probe(struct.pack("<QQ", native.MAGIC, 0) + bytes(48), "ns", keys)
    lying = bytearray(mm[:native.HEADER_BYTES])  # a header that claims more slots than the buffer holds
    struct.pack_into("<Q", lying, 8, 1 << 20)
    with pytest.raises(ValueError, match="needs"):
        native.probe(bytes(lying) + bytes(64 * native.SLOT_BYTES), "ns", keys)
    with pytest.raises(ValueError, match="not a power of two"):
        IndexTable("x", 100, 1)


def test_a_client_descriptor_is_read_only_and_cannot_resize_the_table(table: IndexTable) -> None:
    fd = table.reader_fd()
    try:
        assert os.fstat(fd).st_size == table.size
        with pytest.raises(PermissionError):
            mmap.mmap(fd, table.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fd, b"x")
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ValueError, match="less than its header"):
        IndexView(r)  # an empty file is no key index (and its descriptor is closed all the same)
    with pytest.raises(OSError):
        os.close(r)


def test_capacity_for_keeps_tables_at_most_half_full() -> None:
    assert [capacity_for(n) for n in (0, 1, 2, 3, 100, 262144)] == [2, 2, 4, 8, 256, 524288]


def _churn(table: IndexTable, keys: list[bytes], seconds: float) -> None:
    """Writer process: insert and remove `keys` (each with id 1000 + its index, serial 7) as fast as it can."""
    deadline = time.monotonic() + seconds
    ids = [1000 + i for i in range(len(keys))]
    while time.monotonic() < deadline:
        for i in range(0, len(keys), 8):
            table.insert("ns", keys[i:i + 8], ids[i:i + 8], [7] * len(keys[i:i + 8]))
        for i in range(0, len(keys), 8):
            table.remove("ns", keys[i:i + 8])


def test_a_reader_racing_a_writer_never_sees_a_wrong_entry() -> None:
    """The stable chain is indexed once and never touched; another process churns other keys through the same
    slots. Every probe of the chain returns all of it with the right ids, or None (the writer kept the sequence
    moving); a churning key, when found, has exactly its own id; a key never inserted is never found."""
    t = IndexTable("race", 256, 1)
    stable, churn, never = keyset("stable", 60), keyset("churn", 100), keyset("never", 40)
    t.insert("ns", stable, list(range(60)), list(range(100, 160)), [4096] * 60, [8192 * i for i in range(60)],
             [7 * i for i in range(60)])
    view = IndexView(t.reader_fd())
    want = (60, struct.pack("<60I", *range(60)), struct.pack("<60I", *range(100, 160)))
    columns = ([4096] * 60, [8192 * i for i in range(60)], [7 * i for i in range(60)])
    proc = multiprocessing.get_context("fork").Process(target=_churn, args=(t, churn, 2.0))
    proc.start()
    answers = retries = churn_found = 0
    try:
        time.sleep(0.2)
        while proc.is_alive():
            got = view.probe("ns", stable)
            if got is None:
                retries += 1
            else:
                assert got == want
                answers += 1
            cols = view.entries("ns", stable)  # every column of a batch is read under one sequence number
            if cols is not None:
                assert (cols.n, cols.ids, cols.serials) == want
                assert (cols.sizes.tolist(), cols.offsets.tolist(), cols.checksums.tolist()) == columns
            for i, k in enumerate(churn[:20]):
                one = view.probe("ns", [k])
                if one is not None and one[0]:
                    assert (u32s(one[1]), u32s(one[2])) == ([1000 + i], [7])
                    churn_found += 1
            assert view.probe("ns", never[:1]) in ((0, b"", b""), None)
    finally:
        proc.join(10)
        t.close()
    assert proc.exitcode == 0
    assert answers > 100 and churn_found > 0, (answers, retries, churn_found)
    print(f"\n{answers} stable probes answered, {retries} gave way to the writer, {churn_found} churn keys seen")


def test_the_catalog_check_counts_the_leading_entries_that_still_hold() -> None:
    state = np.array([2, 2, 1, 2, 2], dtype=np.uint8)
    ns = np.array([3, 3, 3, 4, 3], dtype=np.uint16)
    serial = np.array([10, 11, 12, 13, 14], dtype=np.uint32)

    def check(ids: list[int], serials: list[int], n: int = 5) -> int:
        return native.check(np.array(ids, dtype="<u4"), np.array(serials, dtype="<u4"), state, ns, serial, n, 3, 2)
    assert check([0, 1, 4], [10, 11, 14]) == 3
    assert check([0, 2], [10, 12]) == 1        # id 2 is not committed
    assert check([1, 3], [11, 13]) == 1        # id 3 is another namespace's
    assert check([4, 0], [14, 99]) == 1        # id 0 was reused since (another serial)
    assert check([0, 5], [10, 0]) == 1         # id 5 is past the catalog
    assert check([0, 4], [10, 14], n=4) == 1   # and so is 4 when the catalog has 4 entries
    assert check([], []) == 0
    with pytest.raises(ValueError, match="one length"):
        check([0, 1], [10])
    with pytest.raises(ValueError, match="shorter"):
        check([0], [10], n=6)


def _mapped_rss_kib(name: str) -> list[int]:
    """Rss (KiB) of each mapping of this process whose path names `name` (/proc/self/smaps)."""
    out, current = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
                current = name in line
            elif current and head[0] == "Rss:":
                out.append(int(head[1]))
    return out


def test_both_sides_map_the_whole_table_up_front() -> None:
    # a key hashes to a random slot: a table mapped as touched would page-fault on most new keys (the writer's
    # inserts, a reader's probes); 1,024 slots of 48 bytes = 12 pages of slots after the header's page(s)
    t = IndexTable("resident-check", 1024, incarnation=1)
    try:
        pages = -(-t.size // 4096)
        view = IndexView(t.reader_fd())
        assert _mapped_rss_kib("kvstore-keyindex-resident-check") == [pages * 4, pages * 4]  # the daemon's, the client's
        del view
    finally:
        t.close()
