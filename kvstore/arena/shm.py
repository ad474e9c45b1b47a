"""The RAM tier's memory: one POSIX shared-memory file that the daemon creates and local clients map.

Layout of the mapping::

    [ generation table: one uint64 per data page ][ pad to 2 MiB ][ data: slots, page-aligned ... ]

Why each choice:
- One file, mapped by every local client, so a put or get is a plain memcpy (or a GPU DMA once a GPU process
  registers the mapping as pinned host memory). gRPC never carries these bytes.
- Pre-faulted at start (posix_fallocate + MAP_POPULATE): first touch of fresh memory runs ~10x slower than a
  warm copy on this kind of machine, and that cost must not land on the first puts.
- mlock'ed when the OS allows, so the kernel never swaps KV blocks out; `locked` reports the truth.
- Owner-only permissions (0600): the arena holds other requests' KV cache.
- An exclusive flock held by the creating daemon tells a stale file (daemon died, lock gone: safe to replace)
  from a live one (another daemon owns this name: refuse to start).
- The generation table lives in the mapping itself so a reader can check, after its copy and without an RPC,
  that the slot was not reclaimed under it (see `generation_index`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np

from kvstore.errors import ConfigError

__all__ = ["ArenaLayout", "SharedArena", "attach_arena", "SHM_DIR"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PAGE_BYTES = 4096
DATA_ALIGN = 2 * 1024 * 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@dataclass(frozen=True)
class ArenaLayout:
    """Where things are inside the mapping; sent to clients in Health so they can map the same file."""

    shm_name: str
    size_bytes: int
    data_offset: int
    data_bytes: int
    page_bytes: int = PAGE_BYTES
    gen_table_offset: int = 0

    @staticmethod
    def for_capacity(shm_name: str, data_bytes: int) -> ArenaLayout:
        if data_bytes <= 0 or data_bytes % PAGE_BYTES:
            raise ConfigError(f"arena data size {data_bytes} must be a positive multiple of {PAGE_BYTES}")
        table = (data_bytes // PAGE_BYTES) * 8
        data_offset = -(-table // DATA_ALIGN) * DATA_ALIGN
        return ArenaLayout(shm_name, data_offset + data_bytes, data_offset, data_bytes)

    def generation_index(self, offset: int) -> int:
        """Index in the generation table of the slot that starts at `offset` (from the mapping's start)."""
        return (offset - self.data_offset) // self.page_bytes


def _shm_path(name: str) -> str:
    if not name.startswith("/") or "/" in name[1:] or len(name) < 2:
        raise ConfigError(f"arena name {name!r} must look like '/kvstore-NAME' (one leading slash, no others)")
    return SHM_DIR + name


def _address_of(mm: mmap.mmap) -> int:
    buf = (ctypes.c_char * 1).from_buffer(mm)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


class _MappedFile:
    """A shared mapping of an open shm file plus views on it; base of the daemon and client handles."""

    def __init__(self, layout: ArenaLayout, fd: int, populate: bool) -> None:
        self.layout = layout
        self._fd = fd
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self.mmap = mmap.mmap(fd, layout.size_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = _address_of(self.mmap)
        self.view = np.frombuffer(self.mmap, dtype=np.uint8)
        n_pages = layout.data_bytes // layout.page_bytes
        self.generations = np.frombuffer(self.mmap, dtype=np.uint64, count=n_pages, offset=layout.gen_table_offset)

    def close(self) -> None:
        # numpy views export the mmap buffer; drop them before closing or mmap refuses.
        self.view = None  # type: ignore[assignment]
        self.generations = None  # type: ignore[assignment]
        try:
            self.mmap.close()
        except BufferError:
            # Engine and service hold numpy views until the process exits; the unlinked file is freed then.
            log.debug("arena mapping still referenced by a view; it is unmapped at exit")
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SharedArena(_MappedFile):
    """The daemon's handle: creates, pre-faults, locks and finally removes the shared-memory file."""

    def __init__(self, layout: ArenaLayout, *, lock: str = "auto") -> None:
        if lock not in ("auto", "on", "off"):
            raise ConfigError(f"arena lock mode {lock!r} must be one of auto, on, off")
        self.path = _shm_path(layout.shm_name)
        fd = _create_exclusive(self.path)
        try:
            _preallocate(fd, layout.size_bytes, self.path)
            super().__init__(layout, fd, populate=True)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self.prefaulted = True
        self.locked = False
        if lock != "off":
            self.locked = self._mlock(required=(lock == "on"))

    def _mlock(self, required: bool) -> bool:
        if _libc.mlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.layout.size_bytes)) == 0:
            return True
        err = ctypes.get_errno()
        msg = (
            f"mlock of the {self.layout.size_bytes} byte arena failed ({os.strerror(err)}): raise RLIMIT_MEMLOCK "
            "(ulimit -l / LimitMEMLOCK=infinity) or run with CAP_IPC_LOCK"
        )
        if required:
            self.close()
            os.unlink(self.path)
            raise ConfigError(msg + "; or set arena_lock = 'auto' to run unlocked")
        log.warning("%s; running with an unlocked arena", msg)
        return False

    def destroy(self) -> None:
        """Unmap and remove the shared-memory file (graceful shutdown)."""
        if self.locked and self.mmap is not None and not self.mmap.closed:
            _libc.munlock(ctypes.c_void_p(self.address), ctypes.c_size_t(self.layout.size_bytes))
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ClientArena(_MappedFile):
    """A client's mapping of a daemon's arena (read/write: clients copy into reserved slots)."""


def attach_arena(layout: ArenaLayout) -> ClientArena:
    """Map a running daemon's arena. Raises OSError when the file is absent or not ours to open."""
    fd = os.open(_shm_path(layout.shm_name), os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < layout.size_bytes:
            raise OSError(errno.EINVAL, f"arena {layout.shm_name} is smaller than the daemon announced")
        return ClientArena(layout, fd, populate=True)
    except BaseException:
        os.close(fd)
        raise


def _create_exclusive(path: str) -> int:
    """Create the shm file 0600 and hold an exclusive flock on it; replace a stale one left by a dead daemon."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            _remove_if_stale(path)
            continue
        os.fchmod(fd, 0o600)  # umask can only remove bits, but be explicit
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    raise ConfigError(f"could not create arena file {path}")


def _remove_if_stale(path: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(
            f"arena {path} belongs to a running kvstore-server: stop it or choose another arena_name"
        ) from None
    finally:
        os.close(fd)
    log.warning("removing stale arena %s left by a daemon that is no longer running", path)
    os.unlink(path)


def _preallocate(fd: int, size: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise ConfigError(
            f"cannot allocate {size} bytes for arena {path}: {exc.strerror}; free /dev/shm space or lower arena_bytes"
        ) from exc
