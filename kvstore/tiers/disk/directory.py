"""The disk tier's directory: created owner-only, locked against a second daemon, wiped on request.

One DiskStore owns a directory at a time: `take_lock` flocks DIR/LOCK (non-blocking), so a second process
fails at once with a message that says who holds it instead of corrupting the log. On a read-only filesystem
the lock file cannot be created; an existing one is still locked (read-only open), and a store opened that
way serves reads only until a probe finds the filesystem writable again (store.py); `probe_page` is that
probe's disk half, in a spare file of the directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

from kvstore.errors import ConfigError
from kvstore.tiers.disk.config import PAGE_BYTES
from kvstore.tiers.disk.io import AlignedBuffer, BlockIO

__all__ = ["StoreDirectory", "LOCK_FILE", "PROBE_FILE"]

log = logging.getLogger("kvstore.tiers.disk")

LOCK_FILE = "LOCK"
PROBE_FILE = "probe.blk"
_OUR_FILES = ("data.mdb", "lock.mdb", PROBE_FILE)


class StoreDirectory:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock_fd = -1

    @property
    def locked(self) -> bool:
        return self._lock_fd >= 0

    def prepare(self) -> bool:
        """Create the directory (0700), take its lock file; returns whether the filesystem accepts writes."""
        d = self.path
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create disk directory {d}: {exc.strerror}; create it or choose another") from exc
        writable = self.take_lock(create=True)
        return writable and os.access(d, os.W_OK)

    def take_lock(self, *, create: bool) -> bool:
        """flock DIR/LOCK so two daemons never share a directory; False when only a read-only open was possible."""
        path = os.path.join(self.path, LOCK_FILE)
        writable = True
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0) | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ConfigError(f"cannot open {path}: {exc.strerror}") from exc
            writable = False
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return False   # a read-only directory without a lock file: nobody can write here anyway
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"disk directory {self.path} is in use by another process (lock {path} is held): stop "
                "it or choose another directory"
            ) from None
        self.release()
        self._lock_fd = fd
        return writable

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def wipe(self) -> None:
        """Erase the index and every segment file (the lock file stays: we hold it)."""
        d = self.path
        names = set(_OUR_FILES)
        names.update(e.name for e in os.scandir(d) if e.name.startswith("segment-") and e.name.endswith(".kvd"))
        for name in names:
            try:
                os.unlink(os.path.join(d, name))
            except FileNotFoundError:
                pass
        log.warning("disk tier at %s wiped: every cached block was erased", d)

    def probe_page(self, io: BlockIO) -> None:
        """Write, sync and read back one page of fresh random bytes in the spare file DIR/probe.blk: the cheapest
        proof that the device takes writes again (OSError when it does not)."""
        path = os.path.join(self.path, PROBE_FILE)
        buf = AlignedBuffer(2 * PAGE_BYTES)
        try:
            pattern = os.urandom(PAGE_BYTES)
            buf.view(PAGE_BYTES)[:] = pattern
            fd = io.open(path, create=True)
            try:
                io.pwrite(fd, buf.address, PAGE_BYTES, 0)
                io.fdatasync(fd)
                got = io.pread(fd, buf.address + PAGE_BYTES, PAGE_BYTES, 0)
            finally:
                io.close(fd)
            if got != PAGE_BYTES or bytes(buf.view(2 * PAGE_BYTES)[PAGE_BYTES:]) != pattern:
                raise OSError(errno.EIO, "probe read back other bytes than it wrote", path)
        finally:
            buf.close()
