"""DiskConfig: the disk tier's one typed config object, validated at construction (fails loudly, says how to fix).

This is the one place the disk settings' rules live: the daemon (kvstore/server/config/) builds a DiskConfig
and does not repeat them. With the disk tier off (disk_bytes = 0) there is no DiskConfig, but the daemon still
checks the settings that do not need a directory (`check_disk_options`), so a typo surfaces at once. Messages
name the daemon setting (disk_segment_bytes, ...) because that is what a user changes. The codec names come
from the codec registry (codec.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.tiers.disk.codec import CODECS

__all__ = ["DiskConfig", "PAGE_BYTES", "SYNC_MODES", "CODECS", "DISK_CODECS", "MAX_REINSERT_HITS", "round_up",
           "check_disk_options"]

PAGE_BYTES = 4096            # O_DIRECT alignment of offsets, lengths and buffers; every record starts on a page
MIB = 1 << 20
SYNC_MODES = ("data", "none")
DISK_CODECS = ("", *CODECS)   # what a namespace (or WriteItem.codec) may name; "" = the store's default
MAX_REINSERT_HITS = 255


def round_up(n: int, align: int = PAGE_BYTES) -> int:
    return -(-n // align) * align


def check_disk_options(sync: str, compression: str, probe_interval_s: float, reinsert_hits: int) -> None:
    """The disk settings that need no directory; ConfigError naming the setting and the accepted values."""
    if sync not in SYNC_MODES:
        _fail(f"disk_sync={sync!r}: use one of {', '.join(SYNC_MODES)} ('data' is crash-safe)")
    if compression not in CODECS:
        _fail(f"disk_codec={compression!r}: use one of {', '.join(CODECS)}")
    if not isinstance(probe_interval_s, (int, float)) or not math.isfinite(probe_interval_s) or probe_interval_s <= 0:
        _fail(f"disk_probe_interval_s={probe_interval_s!r} must be a positive number of seconds, e.g. 5")
    hits = reinsert_hits
    if not isinstance(hits, int) or isinstance(hits, bool) or not 0 <= hits <= MAX_REINSERT_HITS:
        _fail(f"disk_reinsert_hits={hits!r}: use 0 (plain FIFO) .. {MAX_REINSERT_HITS}: the reads since "
              "its write that keep a record when its segment is reclaimed, e.g. 1")


def _fail(message: str) -> None:
    raise ConfigError("invalid config: " + message)


@dataclass(frozen=True)
class DiskConfig:
    """Where and how the disk tier stores blocks (daemon setting in brackets).

    directory         [disk_dir] created 0700 if missing; holds the segment files, the lmdb index and a lock file.
    capacity_bytes    [disk_bytes] total data bytes across segment files; rounded DOWN to whole segments
                      (`segments * segment_bytes` is the effective capacity reported by stats()).
    segment_bytes     [disk_segment_bytes] size of one segment file, a multiple of 1 MiB. A block must fit in one
                      segment. It is fixed when the store is created: reopening with another value is refused.
    sync              [disk_sync] "data": fdatasync the data, then commit the index synced (crash-safe);
                      "none": no fsync at all (tests and benchmarks only: a crash may lose or corrupt entries,
                      though checksums still stop bad bytes from being served).
    compression       [disk_codec] codec of writes that do not name one: a name of codec.CODECS.
    probe_interval_s  [disk_probe_interval_s] how often the owner should call probe() on a degraded store.
    reinsert_hits     [disk_reinsert_hits] second chance at reclamation: when the oldest segment is reclaimed, its
                      records read at least this many times since they were written are copied to the head of the
                      log instead of dropped (at most half a segment per reclamation; see writer.py). 0: plain FIFO.
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
            _fail("disk_dir is empty: give a directory on a local filesystem or set disk_bytes = 0")
        seg = self.segment_bytes
        if not isinstance(seg, int) or seg < MIB or seg % MIB:
            _fail(f"disk_segment_bytes={seg!r} must be a positive multiple of 1 MiB ({MIB}), e.g. {256 * MIB} "
                  "(256 MiB)")
        cap = self.capacity_bytes
        if not isinstance(cap, int) or cap // seg < 2:
            _fail(f"disk_bytes={cap!r} holds fewer than 2 segments of {seg} bytes: raise it to at least {2 * seg} "
                  "or lower disk_segment_bytes (FIFO reclamation needs a segment to write while the oldest is "
                  "reclaimed)")
        check_disk_options(self.sync, self.compression, self.probe_interval_s, self.reinsert_hits)

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
