"""The read path: index lookup -> pread (no lock) -> reuse check -> decode -> xxh3 verify.

Three phases, so that read_stream.py can verify one block while the next one's pread is in flight:
open (the lookup; counts the read in flight), land (the pread), verify (the rest; ends the read; or abandon,
after an exception). read_into runs them back to back.

    lookup   under `lock`: the entry, a check that its segment was not reused, the file descriptor; the read
             is counted in flight (close() waits for it).
    pread    no lock. An uncompressed block lands straight in the caller's page-aligned memory (O_DIRECT, whole
             pages: the destination must have round_up(length, 4096) bytes); otherwise through a per-thread
             page-aligned bounce buffer.
    check    under `lock` again: if the segment was reused while we read (FIFO reclamation), the bytes may be the
             new owner's: the answer is NOT_FOUND and the destination is zeroed. Never wrong bytes.
    verify   xxh3_64 of the decoded bytes against the entry. A mismatch (or an undecodable payload) counts a
             checksum failure, drops the entry and answers CHECKSUM_ERROR with the destination zeroed.

Each verified read is timed (the pread call: device time, not this block's decode or hash; in a stream, the
previous block's verification runs inside it, shorter than the read) into the I/O's TransferMeter.

A failed or short pread (EIO, a truncated file) answers IO_ERROR, counts io_errors and drops the entry. Reads
never degrade the store: a bad sector must cost one block, not the tier.
"""

from __future__ import annotations

import ctypes
import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from kvstore.errors import InvalidRequestError
from kvstore.tiers.disk.codec import CODEC_NAMES, CodecError, decode_into
from kvstore.tiers.disk.config import PAGE_BYTES, round_up
from kvstore.tiers.disk.index import IndexEntry, make_key
from kvstore.tiers.disk.io import AlignedBuffer, memory_view
from kvstore.tiers.disk.state import StoreState
from kvstore.tiers.disk.types import DiskStatus

__all__ = ["BlockReader", "Opened"]

NOT_FOUND = DiskStatus.NOT_FOUND


@dataclass
class Opened:
    """A read between open() and verify(): the entry, its descriptor (or the error opening it) and where the
    bytes land. While one exists the read counts in flight (close() waits), so verify() must always follow."""

    ikey: bytes
    entry: IndexEntry
    fd: int
    error: OSError | None
    address: int
    capacity: int
    size: int           # the pread's length: the record's page footprint
    direct: bool        # straight into the destination (else through a bounce buffer)
    buf: int = 0        # where the pread lands (set by land)
    read_s: float = 0.0


class BlockReader:
    def __init__(self, state: StoreState) -> None:
        self._st = state
        self._local = threading.local()
        self._buffers: list[AlignedBuffer] = []
        self._buffers_lock = threading.Lock()

    def close(self) -> None:
        with self._buffers_lock:
            for buf in self._buffers:
                buf.close()
            self._buffers.clear()

    def _bounce(self, size: int, slot: int) -> int:
        """This thread's bounce buffer `slot` (0 or 1: a stream has a landed block and the next one's read)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = (AlignedBuffer(), AlignedBuffer())
            with self._buffers_lock:
                self._buffers.extend(bufs)
        return bufs[slot].ensure(size)

    def read_into(self, namespace: str, key: bytes, address: int, capacity: int) -> tuple[DiskStatus, int]:
        opened = self.open(namespace, key, address, capacity)
        if opened is None:
            return NOT_FOUND, 0
        return self.verify(opened, self.land(opened))

    def open(self, namespace: str, key: bytes, address: int, capacity: int) -> Opened | None:
        """The lookup. None: not stored (or the store closed). Raises InvalidRequestError for a destination too
        small for the block. Otherwise the read counts in flight until verify()."""
        st = self._st
        with st.lock:
            if not st.begin_read():
                return None
            found = None
            try:
                found = self._find(namespace, key, capacity)
            finally:
                if found is None:   # a miss, or a bad request raised: no read in flight after all
                    st.end_read()
        if found is None:
            return None
        ikey, entry, fd, error = found
        size = round_up(entry.stored_length)
        direct = CODEC_NAMES[entry.codec] == "none" and address % PAGE_BYTES == 0 and capacity >= size
        return Opened(ikey, entry, fd, error, address, capacity, size, direct)

    def land(self, r: Opened, during: Callable[[], None] | None = None, slot: int = 0) -> int | OSError:
        """The pread: the count read, or the OSError it failed with. `during` runs while it is in flight (or
        after it, see BlockIO.pread), and also when the pread fails first: a caller's work is never skipped."""
        ran = [False]

        def work() -> None:
            ran[0] = True
            if during is not None:
                during()
        got: int | OSError
        if r.error is not None:
            got = r.error
        else:
            r.buf = r.address if r.direct else self._bounce(r.size, slot)
            started = time.perf_counter()
            try:
                got = self._st.io.pread(r.fd, r.buf, r.size, r.entry.offset, work if during is not None else None)
            except OSError as exc:
                got = exc
            r.read_s = time.perf_counter() - started
        if not ran[0]:
            work()
        return got

    def verify(self, r: Opened, got: int | OSError) -> tuple[DiskStatus, int]:
        """Reuse check, decode, xxh3; the counters. Ends the read in flight, whatever happens."""
        st = self._st
        try:
            if isinstance(got, OSError):   # scrub what a failed pread may have half-written (none if never started)
                scrub = r.address if r.direct and got is not r.error else 0
                return self._io_error(r.ikey, r.entry, got, scrub=scrub)
            return self._check(r, got)
        finally:
            with st.lock:
                st.end_read()

    def abandon(self, r: Opened) -> None:
        """Give up a read that an exception interrupted: scrub the destination (it may hold part of the block)
        and end the read, without counting it either way."""
        try:
            if r.direct:
                ctypes.memset(r.address, 0, r.entry.length)
        finally:
            with self._st.lock:
                self._st.end_read()

    def _find(self, namespace: str, key: bytes, capacity: int) -> tuple[bytes, IndexEntry, int, OSError | None] | None:
        """The entry and its file descriptor (or the error opening it). Caller holds `lock`."""
        st = self._st
        ns_id = st.index.ns_id(namespace)
        if ns_id is None:
            return None
        ikey = make_key(ns_id, bytes(key))
        entry = st.index.get(ikey)
        if entry is None or not st.table.is_current(entry.segment, entry.seq):
            return None
        if entry.length > capacity:
            raise InvalidRequestError(
                f"block {key!r} is {entry.length} bytes but the destination holds {capacity}: pass a buffer of at "
                f"least {round_up(entry.length)} bytes (look the length up first)"
            )
        try:
            return ikey, entry, st.files.fd(entry.segment), None
        except OSError as exc:
            return ikey, entry, -1, exc

    def _check(self, r: Opened, got: int) -> tuple[DiskStatus, int]:
        st, e, address, ikey = self._st, r.entry, r.address, r.ikey
        with st.lock:
            current = st.table.is_current(e.segment, e.seq)
        if not current:   # the segment was reclaimed and reused while we read: a miss, not its new bytes
            if r.direct:
                ctypes.memset(address, 0, e.length)
            return NOT_FOUND, 0
        if got < e.stored_length:
            short = OSError(errno.EIO, f"short read: {got} of {e.stored_length} bytes (file truncated?)")
            return self._io_error(ikey, e, short, scrub=address if r.direct else 0)
        dst = memory_view(address, e.length)
        try:
            if CODEC_NAMES[e.codec] != "none":
                decode_into(CODEC_NAMES[e.codec], memory_view(r.buf, e.stored_length), dst)
            elif not r.direct:
                ctypes.memmove(address, r.buf, e.length)
            ok = xxhash.xxh3_64_intdigest(dst) == e.checksum
        except CodecError:
            ok = False
        if not ok:
            ctypes.memset(address, 0, e.length)
            with st.lock:
                st.counters.checksum_failures += 1
                st.health.read_fault(f"block in segment {e.segment} at offset {e.offset} failed its checksum")
            st.drop_entry(ikey, e)
            return DiskStatus.CHECKSUM_ERROR, 0
        with st.lock:
            st.counters.reads += 1
            st.counters.bytes_read += r.size
            st.table.note_read(e.segment, ikey, e.seq, r.size)   # a hit: a second chance at reclamation; maybe backed
        st.io.note_read(r.size, r.read_s)  # verified reads only, like `reads`: a failed one is an error, not a speed
        return DiskStatus.OK, e.length

    def _io_error(self, ikey: bytes, e: IndexEntry, exc: OSError, scrub: int = 0) -> tuple[DiskStatus, int]:
        st = self._st
        if scrub:
            ctypes.memset(scrub, 0, e.length)
        with st.lock:
            if not st.table.is_current(e.segment, e.seq):
                return NOT_FOUND, 0
            st.counters.io_errors += 1
            st.health.read_fault(f"reading a block of segment {e.segment} at offset {e.offset} failed", exc)
        st.drop_entry(ikey, e)
        return DiskStatus.IO_ERROR, 0
