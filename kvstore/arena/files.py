"""One arena file: an anonymous, sealed memory file (memfd) of the arena's full size, sparse until used.

Why memfd and not a named /dev/shm file: a name can be opened by any process of the same user, so a named
arena is shared with everyone who can guess it. A memfd has no name in any directory; a process gets one only
when the daemon passes it over its unix socket (kvstore/server/fast_server.py), after the token check. It also vanishes with the
last process that holds it, so a killed daemon leaves nothing behind.

Why sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): the tenant's process holds a writable descriptor. Without
seals it could ftruncate the file, and the daemon's next access to a slab of it would die with SIGBUS.
Hole punching by that process only zeroes that tenant's own blocks, which is its own business.

A file is the size of the whole arena, but only the slabs bound to it hold pages (backing.py binds and
unbinds slabs); `resident_bytes` tells how much memory it really holds.
"""

from __future__ import annotations

import fcntl
import os

from kvstore.arena import vm
from kvstore.errors import ConfigError

__all__ = ["ArenaFile"]

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class ArenaFile:
    def __init__(self, label: str, size: int, fd: int = -1) -> None:
        """A new file; or, with `fd`, one a previous daemon made (see `adopt`)."""
        self.label = label
        self.size = size
        if fd >= 0:
            self.fd = fd
            return
        self.fd = os.memfd_create(label[:240] or "kvstore", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(self.fd)
            raise

    @classmethod
    def adopt(cls, fd: int, label: str, size: int) -> ArenaFile:
        """A file handed over by a previous daemon (hand-over restart, systemd's fd store), owned from now on;
        ValueError (fd closed) unless it is a memory file of exactly `size` bytes sealed as this class seals."""
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            os.close(fd)
            raise ValueError(f"arena file {label!r}: not a memory file ({exc.strerror})") from exc
        if st.st_size != size or seals & _SEALS != _SEALS:
            os.close(fd)
            raise ValueError(f"arena file {label!r}: {st.st_size} bytes with seals {seals:#x}, expected {size} "
                             f"bytes sealed {_SEALS:#x}")
        return cls(label, size, fd)

    def reserve(self, offset: int, length: int) -> None:
        """Allocate the range's pages now, so running out of memory is an error here, not a SIGBUS later."""
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as exc:
            raise ConfigError(f"cannot allocate {length} bytes of arena memory ({exc.strerror}): the node is out of "
                              "memory for the arena; lower arena_bytes or free memory") from exc

    def punch(self, offset: int, length: int) -> None:
        vm.punch_hole(self.fd, offset, length)

    def read_u64(self, offset: int) -> int:
        return int.from_bytes(os.pread(self.fd, 8, offset).ljust(8, b"\0"), "little")

    def write_u64(self, offset: int, value: int) -> None:
        os.pwrite(self.fd, (value & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"), offset)

    @property
    def resident_bytes(self) -> int:
        """Memory the file holds now (its allocated pages)."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
