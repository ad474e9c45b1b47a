"""One O_DIRECT transfer in flight while the calling thread keeps working: Linux native AIO via ctypes syscalls.

Why: the disk writer must hash every block it writes (xxh3, recorded at commit). A plain pwrite blocks its
thread for the whole transfer, so the hash either runs after it (serial: ~10 % of the write rate at 2 MiB
blocks) or on a second thread. The second thread, at SCHED_IDLE so as not to take the CPU the I/O path needed,
starved whenever both cores were busy: the writer then waited for a block the helper had taken but could not
run (bench.disk under a CPU hog: 0.16-0.35 of raw O_DIRECT instead of 0.9). Submitting the write with io_submit
and hashing on the same thread before io_getevents keeps exactly ONE request in flight (the queue depth of a
pwrite loop, which the benchmark's limit uses) and needs no second thread.

The same for reads: a promoter verifies (xxh3) the block it read last while its next read is in flight
(reader.py's stream), again one request per thread, the queue depth of the benchmark's pread limit.

    write_during(fd, address, length, offset, work) -> int | None
    read_during(fd, address, length, offset, work) -> int | None    (the same contract; n < length also at EOF)
        None: AIO is not usable here (no io_setup: an old kernel, seccomp, a non-Linux or big-endian host; or
        io_submit refused): nothing was written and `work` did not run, the caller writes synchronously.
        n >= 0: `work()` ran while the write was in flight; n bytes were written (fewer than `length` only on
        a short write, 0 when the completion said EINVAL, which the caller's synchronous retry then reproduces
        and handles as O_DIRECT refused). Any other failed completion raises OSError with its errno.

The transfer always completes (io_getevents) before either returns or raises, also when `work` raises: the
caller's memory is never still in the device's hands after it returns.

Contexts (io_setup) are a per-process kernel resource (fs.aio-max-nr), so they are pooled process-wide: a
context is taken for one call and given back, so there are only as many as calls ever ran at once (the
store's single writer and its promoters). A forked child drops the parent's pool (contexts belong to the parent's memory map).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable

__all__ = ["write_during", "read_during", "available"]

log = logging.getLogger(__name__)

# io_setup, io_destroy, io_getevents, io_submit
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_PREAD, _IOCB_CMD_PWRITE = 0, 1


class _Iocb(ctypes.Structure):
    """struct iocb of linux/aio_abi.h (little-endian field order: aio_key before aio_rw_flags)."""

    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Context:
    """One io_setup context with room for one request, and the iocb / event it reuses."""

    def __init__(self) -> None:
        self.ctx = ctypes.c_ulong(0)
        if _syscall(_SETUP, ctypes.c_long(1), ctypes.byref(self.ctx)) < 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self.iocb = _Iocb()
        self.iocbs = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(self.iocb))
        self.event = _Event()

    def submit(self, opcode: int, fd: int, address: int, length: int, offset: int) -> int:
        """0, or the errno io_submit failed with."""
        cb = self.iocb
        cb.opcode, cb.fildes, cb.buf, cb.nbytes, cb.offset = opcode, fd, address, length, offset
        if _syscall(_SUBMIT, self.ctx, ctypes.c_long(1), self.iocbs) == 1:
            return 0
        return ctypes.get_errno() or errno.EIO

    def reap(self) -> int:
        """Wait for the request in flight; its result (bytes, or -errno)."""
        while True:
            got = _syscall(_GETEVENTS, self.ctx, ctypes.c_long(1), ctypes.c_long(1), ctypes.byref(self.event), None)
            if got == 1:
                return int(self.event.res)
            err = ctypes.get_errno()
            if got < 0 and err != errno.EINTR:   # cannot happen with a valid context; never leave it in flight
                raise OSError(err, "io_getevents failed with a write in flight")

    def destroy(self) -> None:
        _syscall(_DESTROY, self.ctx)


def _load() -> tuple[Callable[..., int] | None, tuple[int, int, int, int]]:
    numbers = _SYSCALLS.get(platform.machine())
    if not sys.platform.startswith("linux") or numbers is None or sys.byteorder != "little":
        return None, (0, 0, 0, 0)
    fn = ctypes.CDLL(None, use_errno=True).syscall   # CDLL: the GIL is released during each call
    fn.restype = ctypes.c_long
    return fn, numbers


_raw_syscall, (_SETUP, _DESTROY, _GETEVENTS, _SUBMIT) = _load()
_pool: list[_Context] = []
_pool_lock = threading.Lock()
_usable = _raw_syscall is not None


def _syscall(*args: object) -> int:
    assert _raw_syscall is not None
    return _raw_syscall(*args)


def _after_fork() -> None:
    global _pool_lock
    _pool.clear()                    # the parent's contexts: not ours to use or destroy
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def available() -> bool:
    """Whether write_during can overlap (false once io_setup failed in this process)."""
    return _usable


def _take() -> _Context | None:
    global _usable
    with _pool_lock:
        if _pool:
            return _pool.pop()
        if not _usable:
            return None
    try:
        return _Context()
    except OSError as exc:
        _usable = False   # e.g. ENOSYS / EPERM under seccomp: every later write is synchronous
        log.warning("native AIO refused (io_setup: %s): the disk tier now hashes each block after its write and "
                    "verifies each read after it (serial; ~10 %% of the disk rate at 2 MiB). Allow io_setup (the "
                    "container's seccomp profile) or raise fs.aio-max-nr; kvstore_disk_native_aio says 0", exc)
        return None


def _give(ctx: _Context) -> None:
    with _pool_lock:
        _pool.append(ctx)


def write_during(fd: int, address: int, length: int, offset: int, work: Callable[[], None]) -> int | None:
    """See the module docstring."""
    return _during(_IOCB_CMD_PWRITE, fd, address, length, offset, work)


def read_during(fd: int, address: int, length: int, offset: int, work: Callable[[], None]) -> int | None:
    """See the module docstring."""
    return _during(_IOCB_CMD_PREAD, fd, address, length, offset, work)


def _during(opcode: int, fd: int, address: int, length: int, offset: int, work: Callable[[], None]) -> int | None:
    ctx = _take()
    if ctx is None:
        return None
    if ctx.submit(opcode, fd, address, length, offset):
        _give(ctx)
        return None   # refused before anything moved (EAGAIN, EINVAL on this file...): do it synchronously
    try:
        work()
    finally:
        res = ctx.reap()   # raises only if the context broke: then it is not given back
        _give(ctx)
    if res == -errno.EINVAL:
        return 0
    if res < 0:
        what = "write" if opcode == _IOCB_CMD_PWRITE else "read"
        raise OSError(-res, f"{os.strerror(-res)} (asynchronous {what} of {length} bytes at {offset})")
    return res
