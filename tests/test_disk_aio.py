"""The writer's overlapped hash: one O_DIRECT write in flight (native AIO, kvstore/tiers/disk/aio.py) while the
writing thread takes that block's xxh3, and every way back to a plain pwrite.

What must hold: the bytes on disk are exactly the block's; the work runs once, on the writer's own thread (no
helper thread to starve); the write has completed before pwrite returns or raises; a completion that says
EINVAL or writes short is finished synchronously; without AIO the same write and hash happen one after the
other; a forked child does not reuse its parent's contexts; and the checksum taken during the write is the one
reads verify (a flipped byte is CHECKSUM_ERROR with the destination zeroed, on both paths).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore.tiers.disk import DiskStatus, DiskStore, aio
from kvstore.tiers.disk import io as disk_io
from kvstore.tiers.disk import writer as disk_writer
from kvstore.tiers.disk.io import BlockIO
from tests.disk_store_helpers import OK, PAGE, Buf, KiB, MiB, cfg, flip_byte, random_bytes, read, write

BLOCK = 256 * KiB


@pytest.fixture
def direct_file(tmp_path: Path) -> Iterator[int]:
    """A preallocated O_DIRECT file (the segment files' kind); skips where the filesystem refuses O_DIRECT."""
    path = tmp_path / "f"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    os.posix_fallocate(fd, 0, 4 * BLOCK)
    yield fd
    os.close(fd)


def contents(fd: int, offset: int, length: int) -> bytes:
    with open(f"/proc/self/fd/{fd}", "rb") as f:   # buffered: a second descriptor, no alignment needed
        f.seek(offset)
        return f.read(length)


def needs_aio() -> None:
    if not aio.available():
        pytest.skip("native AIO is not usable here (io_setup refused)")


# ------------------------------------------------------------------------------------------ aio.write_during
def test_write_during_writes_the_exact_bytes_and_runs_the_work_once(direct_file: int) -> None:
    needs_aio()
    data = random_bytes(BLOCK, 1)
    buf = Buf(BLOCK)
    buf.put(data)
    ran: list[int] = []
    assert aio.write_during(direct_file, buf.address, BLOCK, BLOCK, lambda: ran.append(threading.get_ident())) == BLOCK
    assert ran == [threading.get_ident()]           # once, on the calling thread
    assert contents(direct_file, BLOCK, BLOCK) == data
    assert contents(direct_file, 0, BLOCK) == bytes(BLOCK)   # nothing else written


def test_a_failing_work_propagates_after_the_write_completed(direct_file: int) -> None:
    needs_aio()
    data = random_bytes(BLOCK, 2)
    buf = Buf(BLOCK)
    buf.put(data)

    def boom() -> None:
        raise RuntimeError("hash failed")
    with pytest.raises(RuntimeError, match="hash failed"):
        aio.write_during(direct_file, buf.address, BLOCK, 0, boom)
    assert contents(direct_file, 0, BLOCK) == data   # the device was done with the memory before the raise
    buf.put(bytes(BLOCK))                              # and the context went back to the pool in a usable state
    assert aio.write_during(direct_file, buf.address, BLOCK, 0, lambda: None) == BLOCK
    assert contents(direct_file, 0, BLOCK) == bytes(BLOCK)


def test_a_forked_child_makes_its_own_context(direct_file: int) -> None:
    needs_aio()
    buf = Buf(BLOCK)
    buf.put(b"p" * BLOCK)
    assert aio.write_during(direct_file, buf.address, BLOCK, 0, lambda: None) == BLOCK   # the parent's, pooled
    pid = os.fork()
    if pid == 0:   # the child: the parent's context is not valid in this memory map
        code = 1
        try:
            buf.put(b"c" * BLOCK)
            code = 0 if aio.write_during(direct_file, buf.address, BLOCK, BLOCK, lambda: None) == BLOCK else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert contents(direct_file, 0, BLOCK) == b"p" * BLOCK
    assert contents(direct_file, BLOCK, BLOCK) == b"c" * BLOCK


# ------------------------------------------------------------------------------- BlockIO.pwrite(during=...)
@pytest.mark.parametrize(
    ("answer", "why"),
    [(None, "AIO unusable: plain pwrite, then the work"),
     (0, "the completion said EINVAL: the synchronous loop rewrites it all"),
     (PAGE, "a short write of one page: the loop writes the rest")],
)
def test_pwrite_finishes_what_aio_did_not(
    direct_file: int, monkeypatch: pytest.MonkeyPatch, answer: int | None, why: str
) -> None:
    data = random_bytes(BLOCK, 3)
    buf = Buf(BLOCK)
    buf.put(data)

    def fake(fd: int, address: int, length: int, offset: int, work: Callable[[], None]) -> int | None:
        if answer is None:
            return None                      # nothing written, the work not run
        if answer:
            os.pwrite(fd, memoryview(buf.mm)[:answer], offset)   # what the device did write before it stopped
        work()
        return answer
    monkeypatch.setattr(disk_io.aio, "write_during", fake)
    ran: list[bool] = []
    BlockIO().pwrite(direct_file, buf.address, BLOCK, 2 * BLOCK, during=lambda: ran.append(True))
    assert ran == [True], why
    assert contents(direct_file, 2 * BLOCK, BLOCK) == data, why


# ------------------------------------------------------------------------------------------ the store's writer
@pytest.fixture(params=["aio", "plain"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both write paths: the overlapped one, and the plain pwrite where AIO is unusable."""
    if request.param == "aio":
        needs_aio()
    else:
        monkeypatch.setattr(disk_io.aio, "write_during", lambda *a: None)
    return str(request.param)


def test_the_writer_hashes_each_block_once_on_its_own_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path_kind: str
) -> None:
    blocks = {f"k{i}".encode(): random_bytes(100 * KiB + i, 10 + i) for i in range(3)}
    hashed: list[tuple[int, int]] = []

    class Recorder:
        @staticmethod
        def xxh3_64_intdigest(view: memoryview) -> int:
            hashed.append((threading.get_ident(), len(view)))
            return xxhash.xxh3_64_intdigest(view)
    monkeypatch.setattr(disk_writer, "xxhash", Recorder)
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    try:
        assert write(s, Buf(MiB), "ns", blocks, "none") == [OK, OK, OK]
        me = threading.get_ident()
        assert hashed == [(me, len(v)) for v in blocks.values()]     # the writer itself, each block once
        assert not [t for t in threading.enumerate() if t.name.startswith("kvstore-disk-hash")]
        for k, v in blocks.items():
            rec = s.lookup("ns", k)
            assert rec is not None and rec.checksum == xxhash.xxh3_64_intdigest(v) and rec.codec == "none"
            assert read(s, "ns", k) == (OK, v)
    finally:
        s.close()


def test_a_flipped_byte_after_an_overlapped_write_is_a_checksum_error(tmp_path: Path, path_kind: str) -> None:
    data, other = random_bytes(300 * KiB, 20), random_bytes(300 * KiB, 21)
    s = DiskStore(cfg(tmp_path / "d", sync="data"))
    s.open()
    try:
        assert write(s, Buf(MiB), "ns", {b"k": data, b"ok": other}, "none") == [OK, OK]
        rec = s.lookup("ns", b"k")
        assert rec is not None
        flip_byte(s.segment_path(rec.segment), rec.offset + 12345, 0x01)
        out = Buf(MiB)
        out.arr[:] = 0xAB
        assert s.read_into("ns", b"k", out.address, out.size) == (DiskStatus.CHECKSUM_ERROR, 0)
        assert out.get(len(data)) == bytes(len(data))      # zeroed: not one unverified byte served
        assert s.stats().checksum_failures == 1 and s.lookup("ns", b"k") is None
        assert read(s, "ns", b"ok") == (OK, other)
    finally:
        s.close()


def test_a_refused_io_setup_falls_back_says_so_and_writes_the_exact_bytes(
        direct_file: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """io_setup refused (seccomp, fs.aio-max-nr): write_during answers None (the caller writes synchronously),
    available() turns false (the kvstore_disk_native_aio gauge: 0), and the log says why and what to change."""
    def refused() -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(aio, "_pool", [])              # no pooled context to reuse: the next call sets one up
    monkeypatch.setattr(aio, "_usable", True)
    monkeypatch.setattr(aio, "_Context", refused)
    data = random_bytes(BLOCK, 5)
    buf = Buf(BLOCK)
    buf.put(data)
    ran: list[bool] = []
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk.aio"):
        BlockIO().pwrite(direct_file, buf.address, BLOCK, BLOCK, during=lambda: ran.append(True))
    assert ran == [True] and contents(direct_file, BLOCK, BLOCK) == data
    assert aio.available() is False
    assert [r.getMessage() for r in caplog.records if "native AIO refused" in r.getMessage()] != []
    assert "fs.aio-max-nr" in caplog.text and "kvstore_disk_native_aio" in caplog.text
