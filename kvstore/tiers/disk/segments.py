"""Segment files and the space they hold: where the next record goes and which segment is reclaimed next.

The data lives in `segments` files of `segment_bytes` each, used as one log (as CacheLib BlockCache regions):

    segment-00000.kvd  [rec|rec|rec|...........]   sealed (oldest: reclaimed first)
    segment-00001.kvd  [rec|rec|rec|rec|rec|...]   sealed
    segment-00002.kvd  [rec|rec|....           ]   active: records are appended at its write pointer
    segment-00003.kvd                              free (no file yet, or nothing live in it)

Every record starts on a 4 KiB page (O_DIRECT) and takes round_up(stored_length, 4096) bytes: its footprint.
When the active segment cannot hold the next record it is sealed and a free segment becomes active, else a
sealed one whose records were all deleted (`take_dead`: nothing is lost, and the room a Release let go of
comes back before its turn in the FIFO); when none is, the OLDEST sealed segment is reclaimed whole (FIFO): the store first deletes its index entries in one
committed transaction, then reuses it, so the index never points at overwritten bytes. FIFO by segment keeps
writes sequential and reclamation O(1) per segment; deleted or replaced records simply wait for their segment
to be reclaimed.

Second chance (`reinsert_hits`, the way CacheLib Navy's hits-based reinsertion works): the table counts the
reads of each record since it was written. When the oldest segment is reclaimed, its records read at least
`reinsert_hits` times are copied to the head of the log first (the reclaimed segment itself, compacted in
place, becomes the active one) and their counts start again at 0; only the others leave the tier. So a block
that is read back keeps its place while blocks written once and never read age out in FIFO order. The counts
live in memory only: after a restart every record starts cold.

Each (re)use of a segment gets a fresh `open_seq` from the store's sequence counter, larger than every record
seq before it. A record is valid only while `record.seq >= open_seq[segment]`: a reader checks this before
and after its pread, so a read that raced with reclamation is a miss, never the new owner's bytes. Persisted in
the index, open_seq also restores the FIFO age order at open().

SegmentFiles does the file work (create, preallocate, open); SegmentTable is pure bookkeeping with no I/O and
no lock: the store calls it under its state lock.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterable
import os
import re
import threading

from kvstore.tiers.disk.io import BlockIO

__all__ = ["SegmentFiles", "SegmentTable", "segment_name"]

_NAME_RE = re.compile(r"^segment-(\d{5,})\.kvd$")


def segment_name(seg: int) -> str:
    return f"segment-{seg:05d}.kvd"


class SegmentFiles:
    """The segment files of one directory: lazily opened descriptors, creation with posix_fallocate.

    Descriptors stay open until close_all(); pread/pwrite are positional, so readers and the writer share one
    descriptor per file. `writable` False opens them read-only (a store opened on a read-only filesystem).
    """

    def __init__(self, directory: str, segment_bytes: int, io: BlockIO, *, sync: bool, writable: bool) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.writable = writable
        self._io = io
        self._sync = sync
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()  # guards _fds only: held for an open() syscall, never for data I/O

    def path(self, seg: int) -> str:
        return os.path.join(self.directory, segment_name(seg))

    def existing(self) -> dict[int, int]:
        """Segment number -> file size, for every segment file in the directory."""
        found: dict[int, int] = {}
        for entry in os.scandir(self.directory):
            m = _NAME_RE.match(entry.name)
            if m and entry.is_file(follow_symlinks=False):
                found[int(m.group(1))] = entry.stat(follow_symlinks=False).st_size
        return found

    def fd(self, seg: int) -> int:
        """The descriptor of an existing segment file (OSError when it is gone or unreadable)."""
        fd = self._fds.get(seg)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(seg)
            if fd is None:
                fd = self._io.open(self.path(seg), writable=self.writable)
                self._fds[seg] = fd
            return fd

    def prepare(self, seg: int) -> None:
        """Make segment `seg` ready for appends: create it if missing and preallocate all of it.

        Preallocation makes a full filesystem fail HERE (ENOSPC), once per segment, instead of in the middle of a
        batch; it also restores the size of a file truncated behind our back. Raises OSError.
        """
        path = self.path(seg)
        created = not os.path.exists(path)
        if created:
            fd = self._io.open(path, create=True)
            with self._lock:
                old = self._fds.pop(seg, None)
                self._fds[seg] = fd
            if old is not None:
                self._io.close(old)
        self._io.fallocate(self.fd(seg), 0, self.segment_bytes)
        if created and self._sync:
            self._io.sync_directory(self.directory)

    def remove(self, seg: int) -> None:
        self.forget(seg)
        try:
            os.unlink(self.path(seg))
        except FileNotFoundError:
            pass

    def forget(self, seg: int) -> None:
        with self._lock:
            fd = self._fds.pop(seg, None)
        if fd is not None:
            self._io.close(fd)

    def close_all(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            self._io.close(fd)


class SegmentTable:
    """In-memory state of the log: per segment its write pointer, live records and age; no I/O, no lock."""

    def __init__(self, count: int, segment_bytes: int) -> None:
        self.count = count
        self.segment_bytes = segment_bytes
        self.open_seq = [0] * count                 # seq at which the segment was last (re)used; 0 never
        self.wp = [0] * count                       # next free offset in the segment
        self.live = [0] * count                     # footprint bytes of live records
        self.members: list[dict[bytes, int]] = [{} for _ in range(count)]   # index key -> record seq
        self.seg_ns: list[dict[int, int]] = [{} for _ in range(count)]      # namespace id -> footprint bytes
        self.ns_bytes: dict[int, int] = {}                                   # namespace id -> footprint bytes
        self.reads: list[dict[bytes, int]] = [{} for _ in range(count)]     # index key -> reads since written
        # records read since written and not found unbacked since that read: the ones RAM may hold backed by them
        # (a promoted block), index key -> footprint; and their bytes per segment (cleaning.py's estimate)
        self.maybe_backed: list[dict[bytes, int]] = [{} for _ in range(count)]
        self.maybe_bytes = [0] * count
        self.active: int | None = None
        self.sealed: collections.deque[int] = collections.deque()            # oldest first
        self.free: list[int] = list(range(count - 1, -1, -1))                # pop() takes the lowest

    # -- placement (writer only) ------------------------------------------------------------------------
    def place(self, footprint: int) -> int | None:
        """Offset for a record in the active segment, advancing its write pointer; None when it does not fit."""
        seg = self.active
        if seg is None or self.wp[seg] + footprint > self.segment_bytes:
            return None
        off = self.wp[seg]
        self.wp[seg] = off + footprint
        return off

    def seal_active(self) -> None:
        if self.active is not None:
            self.sealed.append(self.active)
            self.active = None

    def take_free(self) -> int | None:
        return self.free.pop() if self.free else None

    def take_dead(self, busy: set[int]) -> int | None:
        """The oldest sealed segment that no live record holds any more (every record deleted: a Release let go of
        them, or they were rewritten elsewhere), outside `busy` (segments the caller wrote records into that are
        not committed yet): reusable at once, with no reclamation and nothing dropped. None when there is none."""
        for seg in self.sealed:
            if not self.members[seg] and seg not in busy:
                self.sealed.remove(seg)
                return seg
        return None

    def oldest_sealed(self) -> int | None:
        return self.sealed[0] if self.sealed else None

    def cleanest(self, busy: Collection[int]) -> tuple[int, int] | None:
        """The sealed segment outside `busy` with the fewest bytes that may be unbacked (live records, less those
        RAM may hold backed by them), oldest first among equals, and that figure; None when there is none."""
        best: tuple[int, int] | None = None
        for seg in self.sealed:
            if seg in busy:
                continue
            unbacked = self.live[seg] - self.maybe_bytes[seg]
            if best is None or unbacked < best[1]:
                best = (seg, unbacked)
        return best

    def reclaim(self, seg: int, open_seq: int) -> tuple[int, int]:
        """Take a sealed segment for reuse (its entries already deleted). Returns (blocks, bytes) it held."""
        self.sealed.remove(seg)
        held = (len(self.members[seg]), self.live[seg])
        self.reset(seg, open_seq)
        return held

    def reset(self, seg: int, open_seq: int) -> None:
        """Start a new use of `seg`: empty, write pointer 0, a new age. Bumps open_seq BEFORE any write."""
        self.open_seq[seg] = open_seq
        self.wp[seg] = 0
        self.live[seg] = 0
        self.members[seg] = {}
        self.reads[seg] = {}
        self.maybe_backed[seg], self.maybe_bytes[seg] = {}, 0
        for ns, n in self.seg_ns[seg].items():
            self._count_ns(ns, -n)
        self.seg_ns[seg] = {}

    def activate(self, seg: int) -> None:
        assert self.active is None
        self.active = seg

    def release(self, seg: int) -> None:
        """A segment that could not be prepared goes back to the free list (it holds nothing)."""
        self.free.append(seg)
        self.free.sort(reverse=True)

    # -- membership ---------------------------------------------------------------------------------------
    def add(self, seg: int, ikey: bytes, seq: int, footprint: int) -> None:
        self.members[seg][ikey] = seq
        self.live[seg] += footprint
        self._count(seg, ikey, footprint)

    def remove(self, seg: int, ikey: bytes, seq: int, footprint: int) -> bool:
        """Forget one record if the segment still holds that version of it (same seq)."""
        if not 0 <= seg < self.count or self.members[seg].get(ikey) != seq:
            return False
        del self.members[seg][ikey]
        self.reads[seg].pop(ikey, None)
        self.unbacked(seg, [ikey])
        self.live[seg] -= footprint
        self._count(seg, ikey, -footprint)
        return True

    def _count(self, seg: int, ikey: bytes, delta: int) -> None:
        """Per-namespace footprint (tenant disk quotas compare against it); index keys start with the
        big-endian namespace id (index.make_key)."""
        ns = int.from_bytes(ikey[:4], "big")
        per = self.seg_ns[seg]
        left = per.get(ns, 0) + delta
        if left:
            per[ns] = left
        else:
            per.pop(ns, None)
        self._count_ns(ns, delta)

    def _count_ns(self, ns: int, delta: int) -> None:
        left = self.ns_bytes.get(ns, 0) + delta
        if left:
            self.ns_bytes[ns] = left
        else:
            self.ns_bytes.pop(ns, None)

    def note_read(self, seg: int, ikey: bytes, seq: int, footprint: int) -> None:
        """A verified read of the record `seq` of `ikey` (a newer version or a reused segment: ignored). Its
        block may now be in RAM backed by it (a promotion): counted as maybe backed until found otherwise."""
        if 0 <= seg < self.count and self.members[seg].get(ikey) == seq:
            reads = self.reads[seg]
            reads[ikey] = reads.get(ikey, 0) + 1
            maybe = self.maybe_backed[seg]
            if ikey not in maybe:
                maybe[ikey] = footprint
                self.maybe_bytes[seg] += footprint

    def unbacked(self, seg: int, ikeys: Iterable[bytes]) -> None:
        """Records of `seg` that no RAM copy counts on (asked, or gone): no longer maybe backed."""
        maybe = self.maybe_backed[seg]
        for ikey in ikeys:
            fp = maybe.pop(ikey, None)
            if fp is not None:
                self.maybe_bytes[seg] -= fp

    def hot(self, seg: int, min_reads: int) -> list[bytes]:
        """Records of `seg` read at least `min_reads` times since written (none when min_reads is 0)."""
        if min_reads < 1:
            return []
        return [k for k, n in self.reads[seg].items() if n >= min_reads]

    def is_current(self, seg: int, seq: int) -> bool:
        """Whether a record written with `seq` into `seg` can still be there (the segment was not reused since)."""
        return 0 <= seg < self.count and seq >= self.open_seq[seg]

    # -- recovery -----------------------------------------------------------------------------------------
    def restore(self, seg: int, open_seq: int, members: dict[bytes, int], wp: int, live: int,
                ns_live: dict[int, int]) -> None:
        self.open_seq[seg], self.members[seg], self.wp[seg], self.live[seg] = open_seq, members, wp, live
        self.reads[seg] = {}
        self.maybe_backed[seg], self.maybe_bytes[seg] = {}, 0
        for ns, n in self.seg_ns[seg].items():
            self._count_ns(ns, -n)
        self.seg_ns[seg] = dict(ns_live)
        for ns, n in ns_live.items():
            self._count_ns(ns, n)

    def arrange(self) -> None:
        """After restore(): segments with live records are sealed by age, the youngest active; others free."""
        used = sorted((s for s in range(self.count) if self.members[s]), key=lambda s: self.open_seq[s])
        self.sealed = collections.deque(used)
        self.active = self.sealed.pop() if used else None
        in_use = set(used)
        self.free = [s for s in range(self.count - 1, -1, -1) if s not in in_use]
        for s in self.free:
            self.wp[s], self.live[s] = 0, 0

    # -- totals -------------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(self.live)

    @property
    def blocks(self) -> int:
        return sum(len(m) for m in self.members)

