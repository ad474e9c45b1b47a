"""Named monotonic counters of the disk tier (a fixed set: a typo is an AttributeError, not a new counter).

A kvstore.counters.CounterSet like the engine's and the peer tier's; bumped under the store's `lock`.
"""

from __future__ import annotations

from kvstore.counters import CounterSet

__all__ = ["DiskCounters", "COUNTER_NAMES"]

COUNTER_NAMES: tuple[str, ...] = (
    "writes",             # blocks written and committed
    "reads",              # blocks read back and verified
    "bytes_written",      # bytes pwritten to segment files (page-aligned footprints)
    "bytes_read",         # bytes pread from segment files
    "raw_bytes",          # original bytes of committed blocks
    "stored_bytes",       # stored (encoded) bytes of committed blocks: raw/stored is the compression ratio
    "checksum_failures",  # reads whose bytes failed xxh3 (or did not decode)
    "io_errors",          # failed or short reads, plus failed write batches
    "evicted_blocks",     # records dropped by FIFO reclamation of their segment
    "evicted_bytes",      # their original bytes
    "reinserted_blocks",  # records copied to the log's head at reclamation instead (second chance, cleaning)
    "cleaned_segments",   # reclamations of a younger segment that RAM backs enough of (reclaim.py, step 0)
    "quota_kept_blocks",  # of those, records kept because dropping them would put a tenant below its disk quota
    "quota_overcommitted",  # reclamations that ignored quotas: protected bytes exceeded capacity - 2 segments
    "dropped_entries",    # entries dropped for pointing outside the files (open) or at unreadable data
)


class DiskCounters(CounterSet):
    __slots__ = COUNTER_NAMES
