"""Native helpers for kvstore: the batched gather/scatter copy and the connector's copy plans (here, plan.c), and
``_keyindex``, the shared key index's table (key_index.c, used through kvstore/fastpath/key_index.py).

Moving a KV-cache block means moving many small pieces (one per layer and per K/V) plus whole 2 MiB
blocks. Doing that with a Python loop costs microseconds per piece and holds the GIL; the C extension
``kvstore._native._copy`` validates a whole batch of ``(dst_offset, src_offset, length)`` triples up
front, then copies with the GIL released (so the gRPC server and other threads keep running), optionally
on several threads that share the work in 1 MiB chunks.

These wrappers only normalise the index arguments (lists, tuples, numpy arrays of any integer dtype) to
C-contiguous ``np.uint64`` arrays; all checking happens in C. There is deliberately no pure-Python
fallback: a missing build fails loudly at import time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    import kvstore._native._copy as _copy
except ImportError as exc:  # pragma: no cover - only hit on a broken/missing build
    raise ImportError(
        "kvstore's native extension kvstore._native._copy is not built or failed to load "
        f"({exc}). Build it with `pip install -e .` (or `make setup`) from the repository root."
    ) from exc

__all__ = ["copy_batch", "copy_addrs", "copy_buffers", "first_outside", "evict_lines", "plan_pieces", "IndexArray"]

#: Anything np.ascontiguousarray(x, dtype=np.uint64) accepts: a sequence of ints or an integer array.
IndexArray = Sequence[int] | npt.NDArray[np.integer[Any]]


def _u64(x: IndexArray) -> npt.NDArray[np.uint64]:
    return np.ascontiguousarray(x, dtype=np.uint64)


def copy_batch(
    dst: Any,
    src: Any,
    dst_offsets: IndexArray,
    src_offsets: IndexArray,
    lengths: IndexArray,
    *,
    threads: int = 1,
    stream: int = -1,
) -> int:
    """Copy ``src[src_offsets[i]:+lengths[i]]`` to ``dst[dst_offsets[i]:+lengths[i]]`` for every ``i``.

    Offsets and lengths are in BYTES. ``dst`` must be a writable C-contiguous buffer (bytearray,
    numpy array, writable memoryview, mmap, shared memory); ``src`` any readable C-contiguous buffer
    and may be the same object as ``dst`` (ranges must not overlap).

    Everything is validated before the first byte moves, so a rejected call leaves ``dst`` unchanged:
    read-only ``dst`` or a non-uint64 index array raises ``TypeError``; unequal index lengths, an
    out-of-bounds range or offset+length overflow raises ``ValueError`` naming the triple index.
    The copy runs with the GIL released; ``threads`` (clamped to 1..64) splits the work by bytes and
    is ignored below 12 MiB per thread (under ~24 MiB one thread copying from cache is faster than two). ``stream``: -1 (auto) writes pieces of >= 4 KiB of a call of >= 1 MiB
    with non-temporal stores on x86-64 (the destination of a KV transfer is not read back soon, and skipping
    the read-for-ownership is 1.4-1.6x faster here); 0 never; 1 always. The bytes copied are the same.

    Returns:
        The total number of bytes copied.
    """
    return int(_copy.copy_batch(dst, src, _u64(dst_offsets), _u64(src_offsets), _u64(lengths), threads, stream))


def copy_addrs(
    dst_addrs: IndexArray,
    src_addrs: IndexArray,
    lengths: IndexArray,
    *,
    threads: int = 1,
    stream: int = -1,
) -> int:
    """UNCHECKED raw-pointer batch copy: ``memcpy(dst_addrs[i], src_addrs[i], lengths[i])`` for every ``i``.

    WARNING: only equal lengths, non-null addresses and address+length wrap-around are checked. A wrong
    address or length corrupts memory or crashes the process, and the caller must keep the owning
    objects (tensors, arrays, mmaps) alive for the duration of the call. Intended for the vLLM connector,
    which gathers one block's pieces from many per-layer tensors (``torch.Tensor.data_ptr()``,
    ``ndarray.ctypes.data``) into one arena slot. GIL released; ``threads`` and ``stream`` as in
    :func:`copy_batch`.

    Returns:
        The total number of bytes copied.
    """
    return int(_copy.copy_addrs(_u64(dst_addrs), _u64(src_addrs), _u64(lengths), threads, stream))


def copy_buffers(
    addrs: IndexArray,
    lengths: IndexArray,
    buffers: list[Any],
    *,
    into_buffers: bool = False,
    threads: int = 1,
    stream: int = -1,
    check_only: bool = False,
) -> int:
    """Copy each of `buffers` (buffer-protocol objects, C-contiguous) to the raw address addrs[i]
    (``into_buffers=False``: buffers[i] holds exactly lengths[i] bytes), or lengths[i] bytes from addrs[i] into
    it (``into_buffers=True``: writable, at least lengths[i] bytes). The buffers are checked, every one before
    any byte moves (ValueError naming the first bad one); the ADDRESSES ARE NOT (see copy_addrs): the caller
    guarantees that each range is mapped and stays so. ``check_only``: check, copy nothing. Returns the bytes.
    GIL released during the copy; threads and stream as for copy_batch.

    Why not copy_addrs with ``ndarray.ctypes.data``: taking each object's address in Python cost ~2.4 us a block
    (80 us of a put of 32 blocks); one buffer export in C costs a fraction of that."""
    return int(_copy.copy_buffers(_u64(addrs), _u64(lengths), buffers, into_buffers, threads, stream, check_only))


def first_outside(offsets: IndexArray, sizes: IndexArray, lo: int, hi: int, slab: int) -> int:
    """The index of the first range [offsets[i], +sizes[i]) not inside one `slab`-byte slab of [lo, hi) (slabs
    counted from lo), -1 when every one is. ValueError for unequal lengths, slab 0 or lo > hi; OverflowError
    (from the conversion) for a negative value or one past 64 bits."""
    return int(_copy.first_outside(_u64(offsets), _u64(sizes), lo, hi, slab))


def evict_lines(addrs: IndexArray, lengths: IndexArray) -> int:
    """UNCHECKED like copy_addrs: write back and evict the cache lines of each range [addrs[i], +lengths[i])
    (x86-64 clflush); the bytes covered, 0 on other CPUs (nothing done). For benchmarks that copy from memory
    without cooling the rest of the process (bench/copy_limit.py)."""
    return int(_copy.evict_lines(_u64(addrs), _u64(lengths)))


def plan_pieces(slots: npt.NDArray[np.uint64], blocks: npt.NDArray[np.int64], per_slot: int,
                pieces: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64],
                              npt.NDArray[np.uint64]],
                block_bytes: int, num_blocks: int, to_store: bool,
                out: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]) -> int:
    """The copy plan of stored blocks (kvstore_connector/layout.py, KVLayout.plan): for slot s and its j-th vLLM block
    b = blocks[s * per_slot + j] (-1: skipped), every piece p copies pieces[3][p] bytes between the cache address
    pieces[0][p] + b * pieces[1][p] and the slot address slots[s] + j * block_bytes + pieces[2][p] (cache to slot
    when `to_store`). Written into out = (dst, src, lengths), in that order; returns how many entries were
    written. ValueError for a block id outside [-1, num_blocks) (before anything is written), mismatched lengths
    or outputs too short; TypeError for an array that is not 1-D uint64 (blocks: int64; outputs: writable)."""
    base, stride, offset, nbytes = pieces
    return int(_copy.plan_pieces(slots, blocks, per_slot, base, stride, offset, nbytes, block_bytes, num_blocks,
                                 to_store, *out))
