"""Which segment to clean instead of reclaiming the oldest: the one RAM backs most (reclaim.py, step 0).

A record backs RAM when the engine holds its block in RAM counting on that disk copy (disk_write = evict: a
promoted block; `StoreState.resident` says). Dropping it loses no block: RAM writes it again if it evicts it.
So a sealed segment whose other records (the unbacked ones) fill at most CLEAN_SHARE of it can be reused by
copying those few, where reclaiming the oldest would drop everything there that was not read back.

Asking the engine about every record of every segment at each reclamation would cost a lookup per record on
disk. Instead the segment table keeps an upper bound of the backed bytes per segment (`maybe_backed`: records
read since their write, the only way a record comes to back a RAM copy) and this asks only about the candidate:

    loop    take the sealed segment with the fewest maybe-unbacked bytes (oldest first among equals); if even
            that estimate is over the share, there is none. Ask `resident` about its maybe-backed records; those
            RAM does not hold leave `maybe_backed`. If none did, its figure is exact and it is the answer
            (unless it is the oldest: that one is reclaimed the usual way); else take the minimum again.

Every other segment's estimate is at most its true figure, so the answer is the segment with the fewest truly
unbacked bytes (oldest among equals), the same one an exact count would give (bench/replay/sim_disk.py models it
exactly so). Each round drops at least one record from the estimate, so the loop ends. Without `resident`
(disk_write = commit) nothing backs RAM: the deleted records alone make a segment cleanable.
"""

from __future__ import annotations

from collections.abc import Collection

from kvstore.tiers.disk.index import split_key
from kvstore.tiers.disk.state import StoreState

__all__ = ["cleanest", "CLEAN_SHARE"]

CLEAN_SHARE = 1 / 3  # most of a segment its unbacked records may fill for it to be cleaned (copied, not dropped)


def cleanest(st: StoreState, busy: Collection[int]) -> int | None:
    """The segment to clean, or None (reclaim the oldest). Caller holds `writer` but no other store lock (the
    engine's `resident` takes the engine's lock, which never waits for `writer`)."""
    limit = st.config.segment_bytes * CLEAN_SHARE
    while True:
        with st.lock:
            best = st.table.cleanest(busy)
            if best is None or best[1] > limit:
                return None
            seg = best[0]
            maybe = list(st.table.maybe_backed[seg])
            records = [(st.index.ns_name(ns), key) for ns, key in map(split_key, maybe)]
        held = st.resident(records) if st.resident is not None and records else [False] * len(records)
        gone = [k for k, h in zip(maybe, held) if not h]
        if not gone:   # exact: the cleanest; the oldest is reclaimed the usual way
            return None if seg == st.table.oldest_sealed() else seg
        with st.lock:
            st.table.unbacked(seg, gone)
