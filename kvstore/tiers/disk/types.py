"""Value objects of the disk tier: the closed status set, a write request, a record, stats, a recovery report."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["DiskStatus", "WriteItem", "WriteResult", "DiskRecord", "DiskStats", "RecoveryReport"]


class DiskStatus(enum.Enum):
    """Expected outcomes of a block operation (bugs and misconfiguration are exceptions instead).

    OK              done.
    NOT_FOUND       no such block (or it was reclaimed while being read: a miss, never other bytes).
    CHECKSUM_ERROR  the bytes read back failed their xxh3 check; the entry was dropped. Do not use the buffer.
    IO_ERROR        the device failed (EIO, EROFS, EACCES, a short read of a truncated file, an index commit).
    NO_SPACE        the filesystem is full (ENOSPC/EDQUOT), or a batch wanted more than the whole capacity.
    DEGRADED        the store is degraded after a write fault: writes are refused without I/O until probe().
    """

    OK = "ok"
    NOT_FOUND = "not_found"
    CHECKSUM_ERROR = "checksum_error"
    IO_ERROR = "io_error"
    NO_SPACE = "no_space"
    DEGRADED = "degraded"


@dataclass(frozen=True)
class WriteItem:
    """One block to write. `address` points to page-aligned memory (an arena slot) holding `length` bytes, with
    at least round_up(length, 4096) bytes readable. `codec` None means the store's configured default."""

    namespace: str
    key: bytes
    address: int
    length: int
    codec: str | None = None


@dataclass(frozen=True)
class WriteResult:
    """What one write batch did: a status per item, in order, and the reclamation it caused on the way.

    reclaimed   (namespace, key) of every block whose record left the tier because its segment was reclaimed
                during this batch (keys the batch itself rewrote are not listed: they are still there).
    reinserted  records given a second chance instead (copied to the head of the log, see writer.py).
    """

    statuses: list[DiskStatus]
    reclaimed: list[tuple[str, bytes]] = field(default_factory=list)
    reinserted: int = 0


@dataclass(frozen=True)
class DiskRecord:
    """Where a block lives. `length` is the original size, `stored_length` what the codec wrote, `checksum` the
    xxh3_64 of the original bytes; `seq` grows with every write (a replaced key gets a new one)."""

    namespace: str
    key: bytes
    length: int
    stored_length: int
    checksum: int
    segment: int
    offset: int
    seq: int
    codec: str


@dataclass(frozen=True)
class DiskStats:
    """A snapshot. Space numbers count 4 KiB-aligned footprints of live records; evicted_bytes and raw_bytes
    count original block bytes; bytes_written/bytes_read count the stored bytes moved to and from the files."""

    capacity_bytes: int
    used_bytes: int
    blocks: int
    segments_total: int
    segments_free: int
    degraded: bool
    degraded_reason: str
    bytes_written: int
    bytes_read: int
    raw_bytes: int
    stored_bytes: int
    checksum_failures: int
    io_errors: int
    evicted_blocks: int
    evicted_bytes: int
    reads: int
    writes: int
    dropped_entries: int     # index entries dropped: invalid at open, or unreadable / bad at read
    direct_io: bool          # False once the filesystem refused O_DIRECT (buffered + fadvise fallback)
    reinserted_blocks: int = 0   # records kept at reclamation (second chance); their copies count in bytes_*
    quota_kept_blocks: int = 0   # of those, kept for a tenant's disk quota (floors.py)
    quota_overcommitted: int = 0  # reclamations that ignored quotas (protected bytes > capacity - 2 segments)
    cleaned_segments: int = 0    # reclamations of a younger segment RAM backs enough of (cleaning.py)

    @property
    def compression_ratio(self) -> float:
        """Original bytes / stored bytes of everything written since open (1.0 before any write)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True)
class RecoveryReport:
    """What open() found and did.

    created           the directory held no index: a new, empty store.
    wiped             open(wipe=True) erased the previous contents.
    blocks, bytes     live records (and their footprint) after validation.
    dropped_entries   index entries removed because they pointed outside the segment files (missing file,
                      truncated file, segment beyond the configured capacity) or into a reused segment.
    removed_files     segment files beyond the configured number of segments, deleted.
    read_only         the filesystem refused writes: the store serves reads and is degraded until probe().
    """

    created: bool
    wiped: bool
    blocks: int
    bytes: int
    namespaces: int
    segments_in_use: int
    dropped_entries: int
    removed_files: int
    read_only: bool
    elapsed_s: float
