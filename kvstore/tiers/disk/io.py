"""The device seam of the disk tier: BlockIO does aligned file I/O on raw addresses; FaultyIO injects faults.

BlockIO opens files with O_DIRECT, so KV blocks bypass the page cache: they are large, written once and read
back at most once, and caching them would only evict memory the host needs (and make benchmarks lie). When the
filesystem refuses O_DIRECT (EINVAL at open, or at the first I/O on filesystems that accept the flag but not the
I/O) it falls back to buffered I/O plus posix_fadvise(DONTNEED) after each transfer, and says so ONCE.

pwrite / pread(..., during=work) run `work` on the calling thread while the transfer is in flight (aio.py:
native AIO, still one request at a time): the writer hashes each block during its own write, a promoter
verifies the block it read last during its next read.

Every call takes a raw address (an arena slot or an AlignedBuffer) rather than a bytes object, so a write of an
uncompressed block goes straight from the shared-memory arena to the device without a bounce copy. Addresses,
offsets and lengths must be multiples of 4096 (O_DIRECT's rule); the store guarantees it and BlockIO checks it.

Timing: `transfers` (a kvstore.transfers.TransferMeter, shared with the daemon's metrics when the composition
root passes one) receives one observation per write batch (the writer times its pwrites + fdatasync) and per
block read (the reader times its pread): `note_write_batch` / `note_read`.

Errors are plain OSError with the errno of the failing syscall: the store maps ENOSPC/EDQUOT to NO_SPACE and
everything else to IO_ERROR. FaultyIO (as CacheLib Navy's testing devices) wraps a real BlockIO and raises a
chosen errno on chosen calls, so tests exercise the real error paths against real files.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.tiers.disk import aio
from kvstore.tiers.disk.config import PAGE_BYTES
from kvstore.transfers import TransferMeter

__all__ = ["BlockIO", "FaultyIO", "AlignedBuffer", "memory_view", "OPS"]

log = logging.getLogger(__name__)

OPS = ("open", "pwrite", "pread", "fdatasync", "fallocate", "sync_directory")


def memory_view(address: int, length: int) -> memoryview:
    """A writable byte view of `length` bytes at a raw address (no copy). The caller keeps the memory alive."""
    return memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")


class AlignedBuffer:
    """Page-aligned anonymous memory for bounce copies (compressed payloads, short-capacity reads); grows."""

    def __init__(self, size: int = 0) -> None:
        self._mmap: mmap.mmap | None = None
        self.size = 0
        self.address = 0
        if size:
            self.ensure(size)

    def ensure(self, size: int) -> int:
        """Make room for `size` bytes (rounded up to pages) and return the buffer's address."""
        if size > self.size:
            self.close()
            size = -(-size // PAGE_BYTES) * PAGE_BYTES
            self._mmap = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = (ctypes.c_ubyte * 1).from_buffer(self._mmap)
            self.address = ctypes.addressof(buf)
            del buf
            self.size = size
        return self.address

    def view(self, length: int) -> memoryview:
        return memory_view(self.address, length)

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
        self._mmap, self.size, self.address = None, 0, 0


class BlockIO:
    """open / pwrite / pread / fdatasync / fallocate on raw page-aligned memory. Thread-safe (stateless calls)."""

    def __init__(self, *, direct: bool = True, transfers: TransferMeter | None = None) -> None:
        self.direct = direct          # False once the filesystem refused O_DIRECT (or when built without it)
        self.transfers = transfers if transfers is not None else TransferMeter()
        self._buffered: set[int] = set()
        self._warned = False
        self._lock = threading.Lock()

    # -- files ------------------------------------------------------------------------------------------
    def open(self, path: str, *, create: bool = False, writable: bool = True) -> int:
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refused(path, exc)
        fd = os.open(path, flags, 0o600)
        with self._lock:
            self._buffered.add(fd)
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._buffered.discard(fd)
        os.close(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        """Reserve the blocks now, so a full filesystem shows up here as ENOSPC rather than in a later write."""
        os.posix_fallocate(fd, offset, length)

    def sync_directory(self, path: str) -> None:
        """Make file creations in `path` durable (a new segment file must survive a crash with its data)."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- data -------------------------------------------------------------------------------------------
    def pwrite(self, fd: int, address: int, length: int, offset: int,
               during: Callable[[], None] | None = None) -> None:
        """Write exactly `length` bytes from `address` at `offset` (all three page-aligned).

        `during`: work for this thread while the write is in flight (the writer hashes the block it writes),
        with the request submitted by native AIO (aio.py: still one request at a time). Where AIO cannot be
        used it runs after a plain pwrite. It runs at most once, and not at all when the write fails first."""
        _check_aligned(address, length, offset)
        done = 0
        if during is not None:
            got = aio.write_during(fd, address, length, offset, during) if fd not in self._buffered else None
            if got is None:
                self._write_from(fd, address, length, offset, 0)
                during()
                return
            done = got   # the whole block, but for a short write or an EINVAL: the loop retries the rest
        self._write_from(fd, address, length, offset, done)

    def _write_from(self, fd: int, address: int, length: int, offset: int, done: int) -> None:
        view = memory_view(address, length)
        while done < length:
            try:
                n = os.pwrite(fd, view[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self._drop_direct(fd, exc):
                    continue
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"pwrite of {length - done} bytes at {offset + done} wrote nothing")
            done += n
        if fd in self._buffered:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def pread(self, fd: int, address: int, length: int, offset: int,
              during: Callable[[], None] | None = None) -> int:
        """Read up to `length` bytes into `address`; fewer only at end of file. Returns the count.

        `during`: as pwrite's (a promoter verifies the block it read last while this read is in flight)."""
        _check_aligned(address, length, offset)
        done = 0
        if during is not None:
            got = aio.read_during(fd, address, length, offset, during) if fd not in self._buffered else None
            if got is None:
                done = self._read_from(fd, address, length, offset, 0)
                during()
                return done
            if got == length:
                return got
            done = got   # EOF, a short read or an EINVAL: the loop finds out which
        return self._read_from(fd, address, length, offset, done)

    def _read_from(self, fd: int, address: int, length: int, offset: int, done: int) -> int:
        view = memory_view(address, length)
        while done < length:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self._drop_direct(fd, exc):
                    continue
                raise
            if n <= 0:
                break
            done += n
        if fd in self._buffered:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        return done

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)
        if fd in self._buffered:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # dirty pages are clean now: drop them

    # -- timing -----------------------------------------------------------------------------------------
    def note_write_batch(self, nbytes: int, seconds: float) -> None:
        """A write batch put `nbytes` (page footprints) on the device in `seconds` (pwrites + data sync)."""
        self.transfers.observe("disk", "disk", "in", nbytes, seconds)

    def note_read(self, nbytes: int, seconds: float) -> None:
        """A block read took `nbytes` (page footprint) off the device in `seconds` (the pread alone)."""
        self.transfers.observe("disk", "disk", "out", nbytes, seconds)

    # -- O_DIRECT fallback ------------------------------------------------------------------------------
    def _refused(self, path: str, exc: OSError) -> None:
        with self._lock:
            self.direct = False
            if self._warned:
                return
            self._warned = True
        log.warning(
            "the filesystem of %s refuses O_DIRECT (%s): the disk tier falls back to buffered I/O with "
            "posix_fadvise(DONTNEED); put the disk directory on ext4/xfs for direct I/O",
            os.path.dirname(path) or ".", exc.strerror,
        )

    def _drop_direct(self, fd: int, exc: OSError) -> bool:
        """EINVAL from an aligned O_DIRECT transfer: the filesystem accepted the flag but not the I/O."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if fd in self._buffered or not flags & os.O_DIRECT:
            return False
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        with self._lock:
            self._buffered.add(fd)
        self._refused(f"/proc/self/fd/{fd}", exc)
        return True


def _check_aligned(address: int, length: int, offset: int) -> None:
    if (address | length | offset) % PAGE_BYTES:
        raise ValueError(
            f"unaligned disk I/O (address={address:#x}, length={length}, offset={offset}): all must be multiples "
            f"of {PAGE_BYTES} for O_DIRECT"
        )


# ----------------------------------------------------------------------------------------- fault injection
@dataclass
class _Rule:
    op: str
    errno: int
    times: int | None       # None: until clear()
    skip: int               # let this many matching calls through first
    path: str | None        # only files whose path contains this


class FaultyIO(BlockIO):
    """A real BlockIO whose chosen calls fail with a chosen errno (tests and chaos drills).

        io = FaultyIO()
        io.inject("pwrite", errno.EIO)              # every pwrite fails until io.clear()
        io.inject("pread", errno.EIO, times=1)      # the next pread fails once
        io.inject("fallocate", errno.ENOSPC, skip=2, path="segment-")

    `calls` counts every call by op (attempted, including failed ones); `injected` counts raised faults.
    """

    def __init__(self, *, direct: bool = True, transfers: TransferMeter | None = None) -> None:
        super().__init__(direct=direct, transfers=transfers)
        self._rules: list[_Rule] = []
        self._paths: dict[int, str] = {}
        self._flock = threading.Lock()
        self.calls: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()

    def inject(self, op: str, err: int, *, times: int | None = None, skip: int = 0, path: str | None = None) -> None:
        if op not in OPS and op != "*":
            raise ValueError(f"unknown op {op!r}: choose one of {', '.join(OPS)} or '*'")
        with self._flock:
            self._rules.append(_Rule(op, err, times, skip, path))

    def clear(self) -> None:
        with self._flock:
            self._rules.clear()

    def _hit(self, op: str, path: str) -> None:
        with self._flock:
            self.calls[op] += 1
            for rule in self._rules:
                if rule.op not in (op, "*") or (rule.path is not None and rule.path not in path):
                    continue
                if rule.skip > 0:
                    rule.skip -= 1
                    continue
                if rule.times is not None:
                    if rule.times <= 0:
                        continue
                    rule.times -= 1
                self.injected[op] += 1
                raise OSError(rule.errno, f"{os.strerror(rule.errno)} (injected by FaultyIO)", path)

    def open(self, path: str, *, create: bool = False, writable: bool = True) -> int:
        self._hit("open", path)
        fd = super().open(path, create=create, writable=writable)
        with self._flock:
            self._paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        with self._flock:
            self._paths.pop(fd, None)
        super().close(fd)

    def _path(self, fd: int) -> str:
        return self._paths.get(fd, "")

    def pwrite(self, fd: int, address: int, length: int, offset: int,
               during: Callable[[], None] | None = None) -> None:
        self._hit("pwrite", self._path(fd))
        super().pwrite(fd, address, length, offset, during)

    def pread(self, fd: int, address: int, length: int, offset: int,
              during: Callable[[], None] | None = None) -> int:
        self._hit("pread", self._path(fd))
        return super().pread(fd, address, length, offset, during)

    def fdatasync(self, fd: int) -> None:
        self._hit("fdatasync", self._path(fd))
        super().fdatasync(fd)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        self._hit("fallocate", self._path(fd))
        super().fallocate(fd, offset, length)

    def sync_directory(self, path: str) -> None:
        self._hit("sync_directory", path)
        super().sync_directory(path)
