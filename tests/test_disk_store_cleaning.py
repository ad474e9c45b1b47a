"""Cleaning (kvstore/tiers/disk/cleaning.py, reclaim.py step 0): when a younger sealed segment holds at most a
third of itself in records RAM does not back (deleted records and records whose block RAM holds counting on
them are free), it is reused instead of the oldest: its unbacked records are copied to its start, the backed
ones leave, and the oldest segment's records stay. The estimate behind the choice is checked against the
engine's answer (`set_resident`) before it decides, so a record read back that RAM did not keep never makes
a segment look cleaner than it is.

Same shapes as tests/test_disk_store_reclaim.py: 3 segments of 1 MiB, 4 blocks of 256 KiB each.
"""

from __future__ import annotations

from kvstore.tiers.disk import DiskStore, WriteItem
from tests.disk_store_helpers import OK, Buf, KiB, MiB, random_bytes, read, store_fixture, write

store = store_fixture()
BLK = 256 * KiB


def _key(i: int) -> bytes:
    return f"b{i:02d}".encode()


def _fill(s: DiskStore, buf: Buf, ids: range) -> dict[int, bytes]:
    data = {i: random_bytes(BLK, 300 + i) for i in ids}
    for i in ids:   # b00-b03 -> seg 0, b04-b07 -> seg 1, b08-b11 -> seg 2
        assert write(s, buf, "ns", {_key(i): data[i]}) == [OK]
    return data


class Backed:
    """The engine's `resident` hook: which (namespace, key) records RAM holds counting on them; records asked."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys
        self.asked: list[list[bytes]] = []

    def __call__(self, records: list[tuple[str, bytes]]) -> list[bool]:
        self.asked.append(sorted(k for _, k in records))
        return [ns == "ns" and k in self.keys for ns, k in records]


def test_a_mostly_deleted_segment_is_cleaned_not_the_oldest(store: DiskStore) -> None:
    buf = Buf(MiB)
    data = _fill(store, buf, range(12))
    assert store.delete("ns", [_key(i) for i in (4, 5, 6)]) == 3       # seg 1: only b07 left (a quarter)
    data[12] = random_bytes(BLK, 312)
    res = store.write_batch([WriteItem("ns", _key(12), buf.put(data[12]), BLK)])
    assert res.statuses == [OK] and res.reclaimed == [] and res.reinserted == 1
    st = store.stats()
    assert (st.evicted_blocks, st.reinserted_blocks, st.cleaned_segments, st.blocks) == (0, 1, 1, 10)
    assert [(store.lookup("ns", _key(i)).segment, store.lookup("ns", _key(i)).offset)  # type: ignore[union-attr]
            for i in (7, 12)] == [(1, 0), (1, BLK)]                  # b07 copied to seg 1's start, then b12
    assert store.contains_many("ns", [_key(i) for i in range(4)]) == [BLK] * 4   # seg 0, the oldest, lost nothing
    for i in (7, *range(8, 13)):      # (not seg 0's: a read gives a record its second chance)
        assert read(store, "ns", _key(i)) == (OK, data[i])
    # seg 1 now b07 b12 b13 b14; seg 0 keeps half of itself live after two deletes: over a third, so the next
    # segment is the oldest again (FIFO: b02, b03 never read, leave)
    data.update({i: random_bytes(BLK, 300 + i) for i in (13, 14, 15)})
    for i in (13, 14):
        assert write(store, buf, "ns", {_key(i): data[i]}) == [OK]
    assert store.delete("ns", [_key(0), _key(1)]) == 2
    res = store.write_batch([WriteItem("ns", _key(15), buf.put(data[15]), BLK)])
    assert res.reclaimed == [("ns", _key(2)), ("ns", _key(3))] and res.reinserted == 0
    assert (store.stats().evicted_blocks, store.stats().cleaned_segments) == (2, 1)
    assert store.lookup("ns", _key(15)).segment == 0                 # type: ignore[union-attr]  # just written
    for i in (7, *range(8, 16)):
        assert read(store, "ns", _key(i)) == (OK, data[i])


def test_records_ram_holds_are_dropped_to_clean_their_segment(store: DiskStore) -> None:
    buf = Buf(MiB)
    data = _fill(store, buf, range(12))
    backed = Backed({_key(4), _key(5), _key(6)})                   # promoted: RAM holds them backed by disk
    store.set_resident(backed)
    for i in (4, 5, 6, 9):                                           # reads: promotions, and b09 one RAM let go
        assert read(store, "ns", _key(i)) == (OK, data[i])
    data[12] = random_bytes(BLK, 312)
    res = store.write_batch([WriteItem("ns", _key(12), buf.put(data[12]), BLK)])
    # seg 1: b07 alone is unbacked (a quarter): cleaned; b04-b06 leave the disk (RAM writes them again when it
    # evicts them), b07 is copied; b09 (read back, then let go of by RAM) makes seg 2 no candidate
    assert res.statuses == [OK] and res.reinserted == 1
    assert res.reclaimed == [("ns", _key(4)), ("ns", _key(5)), ("ns", _key(6))]
    assert [_key(4), _key(5), _key(6)] in backed.asked
    st = store.stats()
    assert (st.evicted_blocks, st.reinserted_blocks, st.cleaned_segments) == (3, 1, 1)
    for i in (*range(4), 7, *range(8, 13)):
        assert read(store, "ns", _key(i)) == (OK, data[i])


def test_a_record_read_back_that_ram_did_not_keep_does_not_make_its_segment_look_clean(store: DiskStore) -> None:
    buf = Buf(MiB)
    data = _fill(store, buf, range(12))
    backed = Backed({_key(4), _key(5)})                              # b06 was read, but RAM let go of it
    store.set_resident(backed)
    for i in (4, 5, 6):
        assert read(store, "ns", _key(i)) == (OK, data[i])
    res = store.write_batch([WriteItem("ns", _key(12), buf.put(random_bytes(BLK, 312)), BLK)])
    # the estimate said seg 1 had one unbacked record (b07); asked, b06 is unbacked too: half, over a third. So
    # the oldest, seg 0, is reclaimed as ever (none of it read: all four leave), and seg 1 keeps everything
    assert backed.asked[0] == [_key(4), _key(5), _key(6)]
    assert res.reclaimed == [("ns", _key(i)) for i in range(4)] and res.reinserted == 0
    assert store.stats().cleaned_segments == 0
    for i in range(4, 12):
        assert read(store, "ns", _key(i)) == (OK, data[i])


def test_without_the_engine_hook_no_record_counts_as_backed(store: DiskStore) -> None:
    buf = Buf(MiB)
    data = _fill(store, buf, range(12))
    for i in (4, 5, 6):                                              # read back, but nothing says RAM holds them
        assert read(store, "ns", _key(i)) == (OK, data[i])
    res = store.write_batch([WriteItem("ns", _key(12), buf.put(random_bytes(BLK, 312)), BLK)])
    assert res.reclaimed == [("ns", _key(i)) for i in range(4)] and store.stats().cleaned_segments == 0
