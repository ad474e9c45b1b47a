"""The read path: index lookup -> pread (no lock) -> reuse check -> decode -> xxh3 verify.

    lookup   under `lock`: the entry, a check that its segment was not reused, the file descriptor; the read
             is counted in flight (close() waits for it).
    pread    no lock. An uncompressed block lands straight in the caller's page-aligned memory (O_DIRECT, whole
             pages: the destination must have round_up(length, 4096) bytes); otherwise through a per-thread
             page-aligned bounce buffer.
    check    under `lock` again: if the segment was reused while we read (FIFO reclamation), the bytes may be the
             new owner's: the answer is NOT_FOUND and the destination is zeroed. Never wrong bytes.
    verify   xxh3_64 of the decoded bytes against the entry. A mismatch (or an undecodable payload) counts a
             checksum failure, drops the entry and answers CHECKSUM_ERROR with the destination zeroed.

Each verified read is timed (the pread alone: device time, not decode or hash) into the I/O's TransferMeter.

A failed or short pread (EIO, a truncated file) answers IO_ERROR, counts io_errors and drops the entry. Reads
never degrade the store: a bad sector must cost one block, not the tier.
"""

from __future__ import annotations

import ctypes
import errno
import threading
import time

import xxhash

from kvstore.errors import InvalidRequestError
from kvstore.tiers.disk.codec import CODEC_NAMES, CodecError, decode_into
from kvstore.tiers.disk.config import PAGE_BYTES, round_up
from kvstore.tiers.disk.index import IndexEntry, make_key
from kvstore.tiers.disk.io import AlignedBuffer, memory_view
from kvstore.tiers.disk.state import StoreState
from kvstore.tiers.disk.types import DiskStatus

__all__ = ["BlockReader"]

NOT_FOUND = DiskStatus.NOT_FOUND


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

    def _bounce(self, size: int) -> int:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = AlignedBuffer()
            with self._buffers_lock:
                self._buffers.append(buf)
        return buf.ensure(size)

    def read_into(self, namespace: str, key: bytes, address: int, capacity: int) -> tuple[DiskStatus, int]:
        st = self._st
        with st.lock:
            if not st.begin_read():
                return NOT_FOUND, 0
            found = None
            try:
                found = self._find(namespace, key, capacity)
            finally:
                if found is None:   # a miss, or a bad request raised: no read in flight after all
                    st.end_read()
        if found is None:
            return NOT_FOUND, 0
        ikey, entry, fd, error = found
        try:
            if error is not None:
                return self._io_error(ikey, entry, error)
            return self._transfer(ikey, entry, fd, address, capacity)
        finally:
            with st.lock:
                st.end_read()

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

    def _transfer(self, ikey: bytes, e: IndexEntry, fd: int, address: int, capacity: int) -> tuple[DiskStatus, int]:
        st = self._st
        size = round_up(e.stored_length)
        direct = CODEC_NAMES[e.codec] == "none" and address % PAGE_BYTES == 0 and capacity >= size
        buf = address if direct else self._bounce(size)
        started = time.perf_counter()
        try:
            got = st.io.pread(fd, buf, size, e.offset)
        except OSError as exc:
            return self._io_error(ikey, e, exc, scrub=address if direct else 0)
        read_s = time.perf_counter() - started
        with st.lock:
            current = st.table.is_current(e.segment, e.seq)
        if not current:   # the segment was reclaimed and reused while we read: a miss, not its new bytes
            if direct:
                ctypes.memset(address, 0, e.length)
            return NOT_FOUND, 0
        if got < e.stored_length:
            short = OSError(errno.EIO, f"short read: {got} of {e.stored_length} bytes (file truncated?)")
            return self._io_error(ikey, e, short, scrub=address if direct else 0)
        dst = memory_view(address, e.length)
        try:
            if CODEC_NAMES[e.codec] != "none":
                decode_into(CODEC_NAMES[e.codec], memory_view(buf, e.stored_length), dst)
            elif not direct:
                ctypes.memmove(address, buf, e.length)
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
            st.counters.bytes_read += size
            st.table.note_read(e.segment, ikey, e.seq, size)   # a hit: a second chance at reclamation; maybe backed
        st.io.note_read(size, read_s)  # verified reads only, like `reads`: a failed one is an error, not a speed
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
