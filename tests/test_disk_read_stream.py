"""DiskStore.read_stream (kvstore/tiers/disk/read_stream.py): each block verified while the next one is read,
and still never a byte served unverified.

Every test runs both ways the overlap can happen: native AIO (the verification inside the next pread) and the
plain pread where AIO is unusable (the verification after it, still inside BlockIO.pread's call). Checked:
the order of reads and reports, a flipped byte (CHECKSUM_ERROR, destination zeroed), a short read of a
truncated segment (IO_ERROR, zeroed), a segment reclaimed and reused while its blocks were landed but not yet
verified (NOT_FOUND, zeroed), compressed blocks in a row (two bounce buffers), and exceptions (every item
reported once, nothing left in flight).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.errors import InvalidRequestError
from kvstore.tiers.disk import BlockIO, DiskStatus, DiskStore, aio
from kvstore.tiers.disk import io as disk_io
from tests.disk_store_helpers import (NOT_FOUND, OK, Buf, KiB, MiB, bf16_like, cfg, flip_byte, random_bytes,
                                      write)

CHECKSUM_ERROR, IO_ERROR = DiskStatus.CHECKSUM_ERROR, DiskStatus.IO_ERROR
SLOT = 256 * KiB


@pytest.fixture(params=["aio", "plain"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "aio":
        if not aio.available():
            pytest.skip("native AIO is not usable here (io_setup refused)")
    else:
        monkeypatch.setattr(disk_io.aio, "read_during", lambda *a: None)
    return str(request.param)


@dataclass(frozen=True)
class Item:
    namespace: str
    key: bytes
    address: int
    capacity: int


class Dest:
    """One destination slot per key, pre-filled with 0xAB so that a left-over byte shows."""

    def __init__(self, keys: list[bytes], slot: int = SLOT) -> None:
        self.buf, self.slot, self.keys = Buf(slot * len(keys)), slot, keys
        self.buf.arr[:] = 0xAB

    def items(self, capacity: int | None = None) -> list[Item]:
        return [Item("ns", k, self.buf.address + i * self.slot, capacity or self.slot) for i, k in enumerate(self.keys)]

    def got(self, key: bytes, n: int) -> bytes:
        return self.buf.get(n, self.keys.index(key) * self.slot)


def stream(s: DiskStore, items: list[Item], log: list[str] | None = None,
           on_done: Callable[[Item], None] | None = None) -> list[tuple[bytes, DiskStatus, int]]:
    """Run one read_stream over `items`; the reports in the order they came."""
    todo, out = iter(items), []

    def done(it: Item, status: DiskStatus, n: int) -> None:
        out.append((it.key, status, n))
        if log is not None:
            log.append(f"done {it.key.decode()}")
        if on_done is not None:
            on_done(it)
    s.read_stream(lambda: next(todo, None), done)
    return out


def open_store(tmp_path: Path, io: BlockIO | None = None, **kw: object) -> DiskStore:
    s = DiskStore(cfg(tmp_path / "d", **kw), io=io)
    s.open()
    return s


# ------------------------------------------------------------------------------------------------ overlap
class LoggedIO(BlockIO):
    """A real BlockIO that logs each pread's start and end, and runs `hook` (once) before its n-th pread."""

    def __init__(self, log: list[str], hook_at: int = 0, hook: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.log, self.n, self.hook_at, self.hook = log, 0, hook_at, hook

    def pread(self, fd: int, address: int, length: int, offset: int,
              during: Callable[[], None] | None = None) -> int:
        self.n += 1
        if self.n == self.hook_at and self.hook is not None:
            self.hook()
        self.log.append(f"pread {self.n}")
        got = super().pread(fd, address, length, offset, during)
        self.log.append(f"end {self.n}")
        return got


def test_each_block_is_verified_and_reported_during_the_next_read(tmp_path: Path, path_kind: str) -> None:
    log: list[str] = []
    s = open_store(tmp_path, LoggedIO(log))
    blocks = {f"k{i}".encode(): random_bytes(100 * KiB + i, i) for i in range(3)}
    assert write(s, Buf(MiB), "ns", blocks) == [OK] * 3
    dest = Dest(list(blocks))
    got = stream(s, dest.items(), log)
    assert got == [(k, OK, len(v)) for k, v in blocks.items()]
    assert log == ["pread 1", "end 1", "pread 2", "done k0", "end 2", "pread 3", "done k1", "end 3", "done k2"]
    assert all(dest.got(k, len(v)) == v for k, v in blocks.items())
    assert s.stats().reads == 3
    s.close()


def test_a_miss_is_reported_at_once_and_the_stream_goes_on(tmp_path: Path, path_kind: str) -> None:
    s = open_store(tmp_path)
    a, b = random_bytes(50 * KiB, 1), random_bytes(60 * KiB, 2)
    assert write(s, Buf(MiB), "ns", {b"a": a, b"b": b}) == [OK, OK]
    dest = Dest([b"a", b"nope", b"b"])
    assert stream(s, dest.items()) == [(b"nope", NOT_FOUND, 0), (b"a", OK, len(a)), (b"b", OK, len(b))]
    assert dest.got(b"a", len(a)) == a and dest.got(b"b", len(b)) == b
    s.close()


# ------------------------------------------------------------------------------------------------- damage
def test_a_flipped_byte_in_a_stream_is_a_checksum_error_with_the_destination_zeroed(
    tmp_path: Path, path_kind: str
) -> None:
    s = open_store(tmp_path)
    blocks = {f"k{i}".encode(): random_bytes(200 * KiB, 10 + i) for i in range(3)}
    assert write(s, Buf(MiB), "ns", blocks) == [OK] * 3
    rec = s.lookup("ns", b"k1")
    assert rec is not None
    flip_byte(s.segment_path(rec.segment), rec.offset + 777, 0x20)
    dest = Dest(list(blocks))
    assert stream(s, dest.items()) == [(b"k0", OK, 200 * KiB), (b"k1", CHECKSUM_ERROR, 0), (b"k2", OK, 200 * KiB)]
    assert dest.got(b"k1", 200 * KiB) == bytes(200 * KiB)     # scrubbed: no unverified byte left there
    assert dest.got(b"k0", 200 * KiB) == blocks[b"k0"] and dest.got(b"k2", 200 * KiB) == blocks[b"k2"]
    st = s.stats()
    assert (st.checksum_failures, st.reads) == (1, 2) and s.lookup("ns", b"k1") is None
    s.close()


def test_a_short_read_in_a_stream_is_an_io_error_with_the_destination_zeroed(tmp_path: Path, path_kind: str) -> None:
    s = open_store(tmp_path)
    blocks = {f"k{i}".encode(): random_bytes(100 * KiB + 1000, 20 + i) for i in range(4)}   # 104 KiB footprints
    assert write(s, Buf(MiB), "ns", blocks) == [OK] * 4
    os.truncate(s.segment_path(0), 2 * 104 * KiB + 48 * KiB)   # k2 cut after 48 KiB, k3 past the end
    dest = Dest([b"k0", b"k2", b"k1", b"k3"])
    n = 100 * KiB + 1000
    assert stream(s, dest.items()) == [(b"k0", OK, n), (b"k2", IO_ERROR, 0), (b"k1", OK, n), (b"k3", IO_ERROR, 0)]
    assert dest.got(b"k2", n) == bytes(n) and dest.got(b"k3", n) == bytes(n)
    assert dest.got(b"k0", n) == blocks[b"k0"] and dest.got(b"k1", n) == blocks[b"k1"]
    st = s.stats()
    assert (st.io_errors, st.reads) == (2, 2) and s.lookup("ns", b"k2") is None and s.lookup("ns", b"k3") is None
    s.close()


def test_a_segment_reused_while_its_blocks_were_read_gives_misses_never_its_new_bytes(
    tmp_path: Path, path_kind: str
) -> None:
    # 3 segments of 1 MiB. a and b (256 KiB each) open segment 0; before the stream's second pread (b), and so
    # before a (landed) is verified, 3 MiB of new blocks reclaim segment 0 and overwrite it. a was landed
    # and b opened with their old entries: both must be misses with zeroed destinations.
    log: list[str] = []
    blk = 256 * KiB
    a, b = random_bytes(blk, 1), random_bytes(blk, 2)
    src = Buf(4 * blk)

    def reuse() -> None:   # on the stream's own thread, inside no lock: as a concurrent writer would
        for i in range(3):
            batch = {f"new{i}-{j}".encode(): random_bytes(blk, 100 + 4 * i + j) for j in range(4)}
            assert write(s, src, "ns", batch) == [OK] * 4
    s = open_store(tmp_path, LoggedIO(log, hook_at=2, hook=reuse))
    assert write(s, src, "ns", {b"a": a, b"b": b}) == [OK, OK]
    rec = s.lookup("ns", b"a")
    assert rec is not None and rec.segment == 0
    dest = Dest([b"a", b"b"])
    assert stream(s, dest.items(), log) == [(b"a", NOT_FOUND, 0), (b"b", NOT_FOUND, 0)]
    assert log[:4] == ["pread 1", "end 1", "pread 2", "done a"]   # a was verified after the reuse
    assert dest.got(b"a", blk) == bytes(blk) and dest.got(b"b", blk) == bytes(blk)
    st = s.stats()
    assert (st.checksum_failures, st.io_errors, st.reads) == (0, 0, 0)
    assert s.lookup("ns", b"a") is None and s.lookup("ns", b"b") is None
    s.close()


def test_compressed_blocks_in_a_row_each_keep_their_bounce_buffer(tmp_path: Path, path_kind: str) -> None:
    s = open_store(tmp_path)
    blocks = {f"z{i}".encode(): bf16_like(150 * KiB, 30 + i) for i in range(5)}
    assert write(s, Buf(MiB), "ns", blocks, "zstd-shuffle2") == [OK] * 5
    assert all(r is not None and r.codec == "zstd-shuffle2" for r in (s.lookup("ns", k) for k in blocks))
    dest = Dest(list(blocks))
    assert stream(s, dest.items()) == [(k, OK, len(v)) for k, v in blocks.items()]
    assert all(dest.got(k, len(v)) == v for k, v in blocks.items())
    assert s.stats().checksum_failures == 0
    s.close()


# ------------------------------------------------------------------------------------------------ exceptions
def closes_promptly(s: DiskStore) -> bool:
    """close() waits for reads in flight: it returning at once shows that none was left."""
    t = threading.Thread(target=s.close)
    t.start()
    t.join(5)
    return not t.is_alive()


def test_a_failing_report_propagates_after_every_taken_item_was_reported(tmp_path: Path, path_kind: str) -> None:
    s = open_store(tmp_path)
    blocks = {f"k{i}".encode(): random_bytes(64 * KiB, 40 + i) for i in range(3)}
    assert write(s, Buf(MiB), "ns", blocks) == [OK] * 3
    dest = Dest(list(blocks))
    reported: list[tuple[bytes, DiskStatus, int]] = []

    def boom(it: Item) -> None:
        if it.key == b"k0":
            raise RuntimeError("the engine refused k0")
    todo = iter(dest.items())
    taken: list[bytes] = []

    def next_item() -> Item | None:
        it = next(todo, None)
        if it is not None:
            taken.append(it.key)
        return it

    def done(it: Item, status: DiskStatus, n: int) -> None:
        reported.append((it.key, status, n))
        boom(it)
    with pytest.raises(RuntimeError, match="refused k0"):
        s.read_stream(next_item, done)
    assert taken == [b"k0", b"k1"]        # the error surfaced once k1 had landed: k2 was never taken
    assert reported == [(b"k0", OK, 64 * KiB), (b"k1", OK, 64 * KiB)]
    assert dest.got(b"k1", 64 * KiB) == blocks[b"k1"]
    assert closes_promptly(s)


def test_a_destination_too_small_raises_after_the_others_were_reported(tmp_path: Path, path_kind: str) -> None:
    s = open_store(tmp_path)
    small, big = random_bytes(4 * KiB, 50), random_bytes(200 * KiB, 51)
    assert write(s, Buf(MiB), "ns", {b"small": small, b"big": big}) == [OK, OK]
    dest = Dest([b"small", b"big"], slot=64 * KiB)
    with pytest.raises(InvalidRequestError, match="destination holds"):
        stream(s, dest.items())
    dest2 = Dest([b"small", b"big"], slot=64 * KiB)
    got: list[tuple[bytes, DiskStatus, int]] = []
    todo = iter(dest2.items())
    with pytest.raises(InvalidRequestError):
        s.read_stream(lambda: next(todo, None), lambda it, st, n: got.append((it.key, st, n)))
    assert got == [(b"big", IO_ERROR, 0), (b"small", OK, 4 * KiB)]   # the landed one still verified
    assert dest2.got(b"small", 4 * KiB) == small
    assert closes_promptly(s)
