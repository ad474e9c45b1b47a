"""Reclaiming a segment: the oldest, with a second chance for the records that were read since they were written,
or a younger one that RAM backs (or deletes) so much of that cleaning it drops no missing block.

A plain FIFO log drops a whole segment when it needs the space, hot blocks included: a block that sessions
keep reading back is dropped as soon as its segment is the oldest, exactly like one written once and never
read. Like CacheLib Navy's hits-based reinsertion, reclamation keeps the records that were read at least
`reinsert_hits` times since their write (SegmentTable counts verified reads) and drops only the others:

    0. which    the sealed segment with the fewest bytes RAM does not back (cleaning.py: its live records less
                those whose block RAM holds backed by them, and deleted ones count as free), when those fill at
                most a third of it (CLEAN_SHARE) and it is not the oldest: it is CLEANED, every record RAM does
                not back is kept (copied), the backed ones leave (RAM writes them again when it evicts them).
                Otherwise the oldest, as below. Why: under disk_write = evict a block read back from disk keeps
                its disk copy while RAM holds it, so promoted sessions leave copies of what RAM holds all over the
                log; FIFO reaches them only when their segment is the oldest, and until then the two tiers hold
                the same blocks twice (full-scale AgentX at 10 %: S3-FIFO + hints 0.80 of hits -> 0.85, Belady
                0.945; docs/benchmarks.md).
    1. choose   under `mutate`: with tenant disk quotas, the records that would put their tenant below its
                quota (floors.py), all of them; then the hot records of the oldest segment, in offset order,
                while everything kept stays within half a segment (so without quotas every reclamation frees at
                least half a segment: a write never cascades through the log, even when everything is hot).
                A hot record whose block the owner holds in RAM backed by it (`StoreState.resident`, asked
                before the store's locks are taken: the engine under disk_write=evict, for a block read back
                from disk) is not kept: RAM holds that block and writes it again when it lets go of it, and
                keeping the copy would spend the log's room on blocks that are not missing from RAM.
    2. reclaim  ONE durable index txn deletes every other entry of the segment and records its new open_seq.
                The kept entries stay in the index but are stale now (seq < open_seq): readers miss them, a
                delete still finds and removes them, recovery drops them.
    3. compact  the segment becomes the active one; each kept record is read into a bounce buffer and written
                at the write pointer. In offset order each copy lands at or before its source and ends before
                the next kept record starts, so no copy overwrites bytes still to be read.
    4. commit   with the batch that caused the reclamation (writer.py: after its fdatasync), each kept entry is
                moved to its new place only if it is still the same version: a block deleted meanwhile stays
                deleted. The moved records start with no reads: they must be read again to survive next time.

Costs: one read and one write per kept record (counted in bytes_read / bytes_written and reinserted_blocks),
and a short window during the copy in which the kept blocks read as misses. A crash anywhere loses at most the
kept records of that one reclamation (their entries are stale until step 4), never serves other bytes.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from kvstore.tiers.disk.cleaning import cleanest
from kvstore.tiers.disk.config import round_up
from kvstore.tiers.disk.floors import protect
from kvstore.tiers.disk.index import IndexEntry, split_key
from kvstore.tiers.disk.io import AlignedBuffer
from kvstore.tiers.disk.state import StoreState

__all__ = ["Reclaimer", "Reclaimed", "Move", "REINSERT_SHARE"]

log = logging.getLogger("kvstore.tiers.disk")

REINSERT_SHARE = 0.5  # most of a reclaimed segment that kept records may fill again


@dataclass(frozen=True)
class Move:
    """A kept record: copied to (segment, offset) with a new seq; `old` is its stale entry."""

    ikey: bytes
    old: IndexEntry
    segment: int
    offset: int
    seq: int

    @property
    def footprint(self) -> int:
        return round_up(self.old.stored_length)

    def entry(self) -> IndexEntry:
        return self.old._replace(segment=self.segment, offset=self.offset, seq=self.seq)


@dataclass
class Reclaimed:
    """One reclaimed segment: the records to copy (offset order) and the index keys whose entries went."""

    segment: int
    keep: list[tuple[bytes, IndexEntry]]
    dropped: list[bytes]


class Reclaimer:
    def __init__(self, state: StoreState) -> None:
        self._st = state
        self._buf = AlignedBuffer()
        self._warned = False

    def close(self) -> None:
        self._buf.close()

    def reclaim_next(self, touched: Collection[int], rewritten: Collection[bytes],
                     pending: Mapping[int, int] | None = None) -> Reclaimed | None:
        """Steps 0-2: a segment to clean, else the oldest sealed one; None when there is none or this batch wrote
        into the oldest.

        `rewritten`: index keys the current batch writes anew (their old record is not worth keeping).
        `pending`: namespace id -> bytes that earlier reclamations of this batch kept and have not committed
        (still the tenant's: tenant quotas count them)."""
        st = self._st
        cfg = st.config
        tenants = self._tenants()
        cleaned = cleanest(st, touched)
        resident = set() if cleaned is not None else self._resident(touched)
        with st.mutate:
            with st.lock:
                seg = cleaned if cleaned is not None else st.table.oldest_sealed()
                if seg is None or seg in touched:
                    return None
                seqs = dict(st.table.members[seg])
                if cleaned is None:
                    hot = [k for k in st.table.hot(seg, cfg.reinsert_hits) if k not in rewritten and k not in resident]
                else:   # every record but the backed ones (those left in maybe_backed after cleanest's check)
                    backed = st.table.maybe_backed[seg]
                    hot = [k for k in seqs if k not in rewritten and k not in backed]
                ns_bytes = dict(st.table.ns_bytes)
                open_seq = st.alloc_seq()
            current = self._current(seg, seqs, hot if tenants is None else [k for k in seqs if k not in rewritten])
            protected = set() if tenants is None else self._protected(current, ns_bytes, pending or {}, tenants)
            keep = self._choose(current, set(hot), protected, int(cfg.segment_bytes * REINSERT_SHARE))
            kept = {k for k, _ in keep}
            removed = st.index.reclaim(seg, open_seq, [k for k in seqs if k not in kept])  # before any byte is reused
            with st.lock:
                st.table.reclaim(seg, open_seq)
                st.counters.cleaned_segments += cleaned is not None
                st.counters.evicted_blocks += len(removed)
                st.counters.evicted_bytes += sum(e.length for _, e in removed)
                st.counters.quota_kept_blocks += len(protected)
        return Reclaimed(seg, keep, [k for k, _ in removed])

    def _resident(self, touched: Collection[int]) -> set[bytes]:
        """Index keys of the oldest segment's hot records whose block the owner holds in RAM backed by them
        (step 1). Asked with no store lock held but the writer's, which alone changes what the oldest segment is."""
        st = self._st
        if st.resident is None:
            return set()
        with st.lock:
            seg = st.table.oldest_sealed()
            hot = [] if seg is None or seg in touched else st.table.hot(seg, st.config.reinsert_hits)
        if not hot:
            return set()
        held = st.resident([(st.index.ns_name(ns), key) for ns, key in map(split_key, hot)])
        return {k for k, r in zip(hot, held) if r}

    def _tenants(self) -> dict[int, str] | None:
        """namespace id -> tenant of every namespace on disk, or None without quotas. Resolved here, before
        the store's locks are taken: the owner lookup takes the daemon's locks (floors.py)."""
        st = self._st
        if st.floors is None:
            return None
        with st.lock:
            ids = list(st.table.ns_bytes)
        return st.floors.tenants({ns: st.index.ns_name(ns) for ns in ids})

    def _current(self, seg: int, seqs: dict[bytes, int], ikeys: list[bytes]) -> list[tuple[bytes, IndexEntry]]:
        """The records among `ikeys` still current in `seg`, in offset order (oldest first)."""
        if not ikeys:
            return []
        found = [(k, e) for k, e in zip(ikeys, self._st.index.get_many(ikeys))
                 if e is not None and e.segment == seg and e.seq == seqs.get(k)]
        found.sort(key=lambda ke: ke[1].offset)
        return found

    def _protected(self, current: list[tuple[bytes, IndexEntry]], ns_bytes: dict[int, int],
                   pending: Mapping[int, int], tenants: dict[int, str]) -> set[bytes]:
        """Records that tenant quotas keep (floors.py), or none when the quotas are overcommitted."""
        st = self._st
        floors = st.floors
        assert floors is not None
        for ns, n in pending.items():
            ns_bytes[ns] = ns_bytes.get(ns, 0) + n
        usage = floors.usage(ns_bytes, tenants)
        limit = st.config.effective_capacity - 2 * st.config.segment_bytes
        if floors.protected_total(usage) > limit:
            with st.lock:
                st.counters.quota_overcommitted += 1
            if not self._warned:
                self._warned = True
                log.warning("disk tier: tenant disk quotas protect more than capacity - 2 segments (%d bytes); "
                            "reclaiming in plain FIFO order until usage drops: lower tenant_disk_quota", limit)
            return set()
        records = ((k, split_key(k)[0], round_up(e.stored_length)) for k, e in current)
        return protect(records, usage, tenants, floors.quota_of)

    def _choose(self, current: list[tuple[bytes, IndexEntry]], hot: set[bytes], protected: set[bytes],
                budget: int) -> list[tuple[bytes, IndexEntry]]:
        """The protected records, then hot ones while the kept bytes stay within `budget`; offset order."""
        keep, used = [], 0
        for k, e in current:
            if k in protected:
                keep.append((k, e))
                used += round_up(e.stored_length)
        hot_left = budget - used
        for k, e in current:
            if k in hot and k not in protected:
                fp = round_up(e.stored_length)
                if fp > hot_left:
                    break
                keep.append((k, e))
                hot_left -= fp
        keep.sort(key=lambda ke: ke[1].offset)
        return keep

    def compact(self, r: Reclaimed) -> tuple[list[Move], list[bytes]]:
        """Step 3, once r.segment is the active segment: copy the kept records to its write pointer.

        Returns the moves and the index keys of kept records that could not be read (they are dropped like the
        rest). A failed pwrite raises OSError: the batch fails and the store degrades, as for any write."""
        st = self._st
        moves: list[Move] = []
        lost: list[bytes] = []
        fd = st.files.fd(r.segment)
        for ikey, e in r.keep:
            fp = round_up(e.stored_length)
            with st.lock:
                off = st.table.place(fp)
                seq = st.alloc_seq()
            assert off is not None and off <= e.offset, "kept records are copied in offset order"
            buf = self._buf.ensure(fp)
            try:
                got = st.io.pread(fd, buf, fp, e.offset)
                if got < e.stored_length:
                    raise OSError(errno.EIO, f"short read: {got} of {e.stored_length} bytes (file truncated?)")
            except OSError as exc:   # a bad sector costs this record, as on the read path; not the batch
                with st.lock:
                    st.counters.io_errors += 1
                    st.health.read_fault(f"reinserting a block of segment {r.segment} at offset {e.offset}", exc)
                lost.append(ikey)
                continue
            st.io.pwrite(fd, buf, fp, off)
            with st.lock:
                st.counters.bytes_read += fp
                st.counters.bytes_written += fp
            moves.append(Move(ikey, e, r.segment, off, seq))
        return moves, lost
