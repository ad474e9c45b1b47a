"""DiskConfig: the disk tier's one typed config object, validated at construction (fails loudly, says how to fix)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["DiskConfig", "PAGE_BYTES", "SYNC_MODES", "CODECS", "DISK_CODECS", "MAX_REINSERT_HITS", "round_up"]

PAGE_BYTES = 4096            # O_DIRECT alignment of offsets, lengths and buffers; every record starts on a page
MIB = 1 << 20
SYNC_MODES = ("data", "none")
CODECS = ("none", "zstd", "zstd-shuffle2")
DISK_CODECS = ("", *CODECS)   # what a namespace (or WriteItem.codec) may name; "" = the store's default
MAX_REINSERT_HITS = 255


def round_up(n: int, align: int = PAGE_BYTES) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class DiskConfig:
    """Where and how the disk tier stores blocks.

    directory         created 0700 if missing; holds the segment files, the lmdb index and a lock file.
    capacity_bytes    total data bytes across segment files; rounded DOWN to whole segments
                      (`segments * segment_bytes` is the effective capacity reported by stats()).
    segment_bytes     size of one segment file, a multiple of 1 MiB. A block must fit in one segment. It is fixed
                      when the store is created: reopening with another value is refused.
    sync              "data": fdatasync the data, then commit the index synced (crash-safe);
                      "none": no fsync at all (tests and benchmarks only: a crash may lose or corrupt entries,
                      though checksums still stop bad bytes from being served).
    compression       codec of writes that do not name one: "none" | "zstd" | "zstd-shuffle2".
    probe_interval_s  how often the owner should call probe() on a degraded store.
    reinsert_hits     second chance at reclamation: when the oldest segment is reclaimed, its records read at
                      least this many times since they were written are copied to the head of the log instead
                      of dropped (at most half a segment per reclamation; see writer.py). 0: plain FIFO.
    """

    directory: str
    capacity_bytes: int
    segment_bytes: int = 256 * MIB
    sync: str = "data"
    compression: str = "none"
    probe_interval_s: float = 5.0
    reinsert_hits: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory:
            raise ConfigError("disk directory is empty: set it to a directory on a local filesystem")
        seg = self.segment_bytes
        if not isinstance(seg, int) or seg < MIB or seg % MIB:
            raise ConfigError(
                f"disk segment_bytes={seg!r} must be a positive multiple of 1 MiB ({MIB}), e.g. {256 * MIB} (256 MiB)"
            )
        cap = self.capacity_bytes
        if not isinstance(cap, int) or cap // seg < 2:
            raise ConfigError(
                f"disk capacity_bytes={cap!r} holds fewer than 2 segments of {seg} bytes: raise capacity_bytes to at "
                f"least {2 * seg} or lower segment_bytes (FIFO reclamation needs a segment to write while the "
                "oldest is reclaimed)"
            )
        if self.sync not in SYNC_MODES:
            raise ConfigError(f"disk sync={self.sync!r} must be one of {', '.join(SYNC_MODES)} ('data' is crash-safe)")
        if self.compression not in CODECS:
            raise ConfigError(f"disk compression={self.compression!r} must be one of {', '.join(CODECS)}")
        interval = self.probe_interval_s
        if not isinstance(interval, (int, float)) or not math.isfinite(interval) or interval <= 0:
            raise ConfigError(f"disk probe_interval_s={interval!r} must be a positive number of seconds, e.g. 5")
        hits = self.reinsert_hits
        if not isinstance(hits, int) or isinstance(hits, bool) or not 0 <= hits <= MAX_REINSERT_HITS:
            raise ConfigError(
                f"disk reinsert_hits={hits!r} must be 0 (plain FIFO) .. {MAX_REINSERT_HITS}: the reads since its "
                "write that keep a record when its segment is reclaimed, e.g. 1"
            )

    @property
    def segments(self) -> int:
        return self.capacity_bytes // self.segment_bytes

    @property
    def effective_capacity(self) -> int:
        return self.segments * self.segment_bytes

    @property
    def index_map_size(self) -> int:
        """lmdb map size: generous (virtual address space only; the file grows with the entries)."""
        return round_up((1 << 30) + self.capacity_bytes // 64, MIB)
