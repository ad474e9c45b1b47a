"""Thin libc wrappers for what Python's mmap module cannot do: MAP_FIXED remaps, explicit munmap, mlock of a
range, hole punching, numpy views on raw addresses.

Why not `mmap.mmap`: the daemon stitches one virtual range out of several files (a MAP_FIXED remap of one
slab at a time), and a client must unmap exactly when the last copy through a mapping has finished, which
mmap.mmap refuses while numpy views of it exist (BufferError) and allows while raw addresses are in use.
Errors come back as OSError with errno, like the os module's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np

__all__ = ["PROT_RW", "MAP_SHARED", "MAP_FIXED", "MAP_POPULATE", "mmap", "munmap", "mlock", "munlock",
           "punch_hole", "last_error", "byte_view", "u64_view", "set_dumpable"]

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

PROT_RW = 0x1 | 0x2
MAP_SHARED = 0x01
MAP_FIXED = 0x10
MAP_POPULATE = 0x08000
_MAP_FAILED = ctypes.c_void_p(-1).value
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_PR_SET_DUMPABLE = 4


def _raise(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def mmap(address: int, length: int, flags: int, fd: int, offset: int, prot: int = PROT_RW) -> int:
    """Map `length` bytes of `fd` at `offset`; `address` is a hint (0) or, with MAP_FIXED, the exact place."""
    got = _libc.mmap(ctypes.c_void_p(address or None), length, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        _raise(f"mmap of {length} bytes")
    return int(got)


def munmap(address: int, length: int) -> None:
    if _libc.munmap(ctypes.c_void_p(address), length) != 0:
        _raise(f"munmap of {length} bytes")


def mlock(address: int, length: int) -> bool:
    """True when the range is locked in RAM; False (errno left for the caller's message) when not allowed."""
    return _libc.mlock(ctypes.c_void_p(address), length) == 0


def last_error() -> str:
    """strerror of the last failed libc call of this thread (for messages after mlock's False)."""
    return os.strerror(ctypes.get_errno())


def munlock(address: int, length: int) -> None:
    _libc.munlock(ctypes.c_void_p(address), length)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give a file range's pages back to the kernel; the range reads as zeros afterwards (size unchanged)."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        _raise(f"punching {length} bytes at {offset}")


def byte_view(address: int, length: int) -> np.ndarray:
    """A uint8 numpy array over raw memory. It does not keep the mapping alive: the owner must."""
    if length == 0:
        return np.zeros(0, dtype=np.uint8)
    raw = (ctypes.c_uint8 * length).from_address(address)
    return np.frombuffer(raw, dtype=np.uint8)  # type: ignore[call-overload]  # ctypes arrays are buffers; numpy's stubs omit them


def u64_view(address: int, count: int) -> np.ndarray:
    """A uint64 numpy array over raw memory (same lifetime rule as byte_view)."""
    raw = (ctypes.c_uint64 * count).from_address(address)
    return np.frombuffer(raw, dtype=np.uint64)  # type: ignore[call-overload]  # ctypes arrays are buffers; numpy's stubs omit them


def set_dumpable(on: bool) -> None:
    """PR_SET_DUMPABLE: off makes /proc/<pid>/{fd,map_files,mem} of this process root-only, so a process of the
    same user cannot open the memory files this process holds (ssh-agent does the same). Also disables
    core dumps of this process."""
    if _libc.prctl(_PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0) != 0:
        _raise("prctl(PR_SET_DUMPABLE)")
