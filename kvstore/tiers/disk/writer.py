"""The write path: one write_many batch = encode -> reserve -> pwrite -> fdatasync -> ONE index commit.

    encode    checksum (xxh3_64 of the original bytes) and, for zstd codecs, compress. CPU only, no lock.
              An uncompressed block is hashed by the writer itself WHILE its own pwrite is in flight
              (BlockIO.pwrite's `during`, native AIO: still one request at a time); the checksum is needed
              only at commit. Why not a helper thread, as before: at normal priority it took the CPU the I/O
              path needed (12 % of the write rate on 2 cores), at SCHED_IDLE it starved whenever both cores
              were busy, and the writer then waited on a block the helper had taken (bench.disk under a CPU
              hog: 0.16-0.35 of raw O_DIRECT).
    reserve   place each record at the active segment's write pointer (under `lock`); a full segment is sealed
              and the next one taken: a free one, or a sealed one whose records were all deleted, else the
              OLDEST sealed one, whose index entries are deleted
              in one committed transaction BEFORE it is reused (under `mutate`), except those of its records
              that get a second chance: those are copied to its start right away (reclaim.py). New segments
              are created and preallocated here, outside every lock but `writer`.
    pwrite    no lock. Uncompressed blocks go straight from the caller's page-aligned memory (an arena slot) to
              the file with O_DIRECT; compressed payloads through a page-aligned bounce buffer.
    fdatasync once per touched file (sync="data"), so the commit below never points at bytes still in flight.
    commit    one lmdb write transaction for the whole batch and the records it reinserted (under `mutate`),
              then the in-memory membership.

write_many returns a WriteResult: the statuses, and which blocks the batch's reclamations dropped (the engine
publishes them as removed from the disk tier) or kept.

Crash at any point: before the commit nothing new is visible, and the bytes a committed entry points at were
synced before it (and are never overwritten while an entry points at them, see reclamation). So a re-opened
store serves committed blocks with their bytes and never a torn block; checksums guard the rest.

Any OSError (data I/O, preallocation, index commit) fails the whole batch with NO_SPACE or IO_ERROR and
degrades the store. A batch larger than the whole capacity is not a fault: what does not fit is NO_SPACE.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvstore.errors import InvalidRequestError
from kvstore.tiers.disk.codec import CODEC_IDS, encode
from kvstore.tiers.disk.config import PAGE_BYTES, round_up
from kvstore.tiers.disk.index import MAX_KEY_BYTES, IndexEntry, make_key, split_key
from kvstore.tiers.disk.io import AlignedBuffer, memory_view
from kvstore.tiers.disk.reclaim import Move, Reclaimer
from kvstore.tiers.disk.state import StoreState
from kvstore.tiers.disk.types import DiskStatus, WriteItem, WriteResult
from kvstore.validation import check_namespace_name

__all__ = ["BatchWriter", "check_items"]

OK, NO_SPACE = DiskStatus.OK, DiskStatus.NO_SPACE


@dataclass
class _Pending:
    pos: int                 # position in the batch
    item: WriteItem
    ikey: bytes
    checksum: int
    codec: int
    payload: bytes | None    # encoded bytes, or None: write the caller's memory as is
    stored: int
    segment: int = -1
    offset: int = -1
    seq: int = 0

    @property
    def footprint(self) -> int:
        return round_up(self.stored)

    def hash_raw(self) -> None:
        """The checksum of an uncompressed block, taken while its pwrite is in flight (see _write)."""
        self.checksum = xxhash.xxh3_64_intdigest(memory_view(self.item.address, self.item.length))


@dataclass
class _Batch:
    """What one write_many call did so far, beyond its own records."""

    rewritten: set[bytes]                                       # index keys of the batch's own items
    dropped: list[bytes] = field(default_factory=list)          # entries reclamation removed
    moves: list[Move] = field(default_factory=list)             # records copied, to commit with the batch
    lost: list[tuple[bytes, int]] = field(default_factory=list)  # kept records that could not be copied (seq)
    kept_ns: dict[int, int] = field(default_factory=dict)       # namespace id -> bytes kept, not yet committed


def check_items(items: Sequence[WriteItem], segment_bytes: int, default_codec: str) -> None:
    """Bad requests are bugs of the caller: raise InvalidRequestError naming the item and the rule."""
    seen: set[tuple[str, bytes]] = set()
    for i, it in enumerate(items):
        check_namespace_name(it.namespace)
        if not isinstance(it.key, (bytes, bytearray)) or not 1 <= len(it.key) <= MAX_KEY_BYTES:
            raise InvalidRequestError(f"item {i}: keys are 1..{MAX_KEY_BYTES} bytes")
        if not isinstance(it.length, int) or it.length < 1 or round_up(it.length) > segment_bytes:
            raise InvalidRequestError(
                f"item {i}: length {it.length!r} must be 1..{segment_bytes} bytes (one segment; raise segment_bytes "
                "for larger blocks)"
            )
        if not isinstance(it.address, int) or it.address <= 0 or it.address % PAGE_BYTES:
            raise InvalidRequestError(f"item {i}: address {it.address!r} must point to page-aligned (4096) memory")
        if (it.codec or default_codec) not in CODEC_IDS:
            raise InvalidRequestError(f"item {i}: codec {it.codec!r} must be one of {', '.join(CODEC_IDS)}")
        if (it.namespace, bytes(it.key)) in seen:
            raise InvalidRequestError(f"item {i}: key repeated in one batch; write each key once per batch")
        seen.add((it.namespace, bytes(it.key)))


class BatchWriter:
    def __init__(self, state: StoreState) -> None:
        self._st = state
        self._bounce = AlignedBuffer()
        self._reclaimer = Reclaimer(state)

    def close(self) -> None:
        self._bounce.close()
        self._reclaimer.close()

    def write_many(self, items: Sequence[WriteItem]) -> WriteResult:
        """Caller holds `writer` and has checked the items."""
        st = self._st
        statuses = [OK] * len(items)
        batch = _Batch(set())
        try:
            pending = self._encode(items)
            batch.rewritten = {p.ikey for p in pending}
            placed = self._reserve(pending, statuses, batch)
            if placed or batch.moves or batch.lost:
                started = time.perf_counter()
                self._write(placed, batch.moves)   # also takes the uncompressed blocks' checksums
                write_s = time.perf_counter() - started
                reinserted = self._commit(placed, batch)
                st.io.note_write_batch(sum(p.footprint for p in placed), write_s)  # metrics: one batch
                written = {p.ikey for p in placed}   # a key whose old record went is still there if rewritten
                return WriteResult(statuses, self._names([k for k in batch.dropped if k not in written]), reinserted)
        except OSError as exc:
            with st.lock:
                status = st.health.fault("writing blocks", exc)
                st.counters.io_errors += 1
            return WriteResult([status] * len(items), self._names(batch.dropped + self._abandon(batch)))
        return WriteResult(statuses, self._names(batch.dropped))

    def _names(self, ikeys: list[bytes]) -> list[tuple[str, bytes]]:
        index = self._st.index
        return [(index.ns_name(ns_id), key) for ns_id, key in map(split_key, ikeys)]

    def _abandon(self, batch: _Batch) -> list[bytes]:
        """A failed batch: its copied records were never committed. Drop their stale entries (best effort: a
        failing disk leaves them to recovery, which drops entries older than their segment) and report them."""
        stale = [(m.ikey, m.old.seq) for m in batch.moves] + batch.lost
        st = self._st
        for ikey, seq in stale:
            try:
                with st.mutate:
                    st.index.delete_if(ikey, seq)
            except OSError:
                break
        with st.lock:
            st.counters.evicted_blocks += len(stale)
        return [k for k, _ in stale]

    # -- encode ---------------------------------------------------------------------------------------------
    def _encode(self, items: Sequence[WriteItem]) -> list[_Pending]:
        st = self._st
        out = []
        for pos, it in enumerate(items):
            view = memory_view(it.address, it.length)
            codec = it.codec or st.config.compression
            payload = encode(codec, view) if codec != "none" else None
            # compressed: hash now (the payload is ready anyway); raw: hashed during its pwrite (_write)
            checksum = xxhash.xxh3_64_intdigest(view) if payload is not None else 0
            if payload is None:
                codec = "none"
            ns_id = st.index.ns_id(it.namespace)
            if ns_id is None:
                with st.mutate:
                    ns_id = st.index.ensure_namespace(it.namespace)
            stored = it.length if payload is None else len(payload)
            out.append(_Pending(pos, it, make_key(ns_id, bytes(it.key)), checksum, CODEC_IDS[codec], payload, stored))
        return out

    # -- reserve --------------------------------------------------------------------------------------------
    def _reserve(self, pending: list[_Pending], statuses: list[DiskStatus], batch: _Batch) -> list[_Pending]:
        st = self._st
        placed: list[_Pending] = []
        touched: set[int] = set()
        for p in pending:
            while True:
                with st.lock:
                    off = st.table.place(p.footprint)
                    if off is not None:
                        p.segment, p.offset, p.seq = st.table.active, off, st.alloc_seq()  # type: ignore[assignment]  # placed: a segment is active
                        touched.add(p.segment)
                        placed.append(p)
                        break
                    st.table.seal_active()
                if not self._next_segment(touched, batch):
                    statuses[p.pos] = NO_SPACE   # the batch alone exceeds the capacity
                    break
        return placed

    def _next_segment(self, touched: set[int], batch: _Batch) -> bool:
        """Activate a free segment, or reclaim the oldest sealed one (copying the records it keeps to its start).
        False when only segments this batch wrote into remain."""
        st = self._st
        with st.lock:
            seg = st.table.take_free()
            if seg is None:
                seg = st.table.take_dead(touched)  # all its records deleted: nothing to reclaim
            if seg is not None:
                st.table.reset(seg, st.alloc_seq())
        reclaimed = None
        if seg is None:
            reclaimed = self._reclaimer.reclaim_next(touched, batch.rewritten, batch.kept_ns)
            if reclaimed is None:
                return False
            seg = reclaimed.segment
            batch.dropped += reclaimed.dropped
            for ikey, e in reclaimed.keep:
                ns = split_key(ikey)[0]
                batch.kept_ns[ns] = batch.kept_ns.get(ns, 0) + round_up(e.stored_length)
        try:
            st.files.prepare(seg)
        except OSError:
            with st.lock:
                st.table.release(seg)
            if reclaimed is not None:   # its kept records were not copied: they are lost with the batch
                batch.lost += [(k, e.seq) for k, e in reclaimed.keep]
            raise
        with st.lock:
            st.table.activate(seg)
        if reclaimed is not None and reclaimed.keep:
            touched.add(seg)
            try:
                moves, lost = self._reclaimer.compact(reclaimed)
            except OSError:   # a failed copy fails the batch: none of the kept records gets committed
                batch.lost += [(k, e.seq) for k, e in reclaimed.keep]
                raise
            batch.moves += moves
            gone = set(lost)
            batch.lost += [(k, e.seq) for k, e in reclaimed.keep if k in gone]
        return True

    # -- write + sync -------------------------------------------------------------------------------------
    def _write(self, placed: list[_Pending], moves: list[Move]) -> None:
        """pwrite the batch's records; fdatasync them and the records reclamation copied (already written)."""
        st = self._st
        io, files = st.io, st.files
        for p in placed:
            fd = files.fd(p.segment)
            if p.payload is None:
                io.pwrite(fd, p.item.address, p.footprint, p.offset, during=p.hash_raw)
            else:
                addr = self._bounce.ensure(p.footprint)
                ctypes.memmove(addr, p.payload, p.stored)
                if p.footprint > p.stored:
                    ctypes.memset(addr + p.stored, 0, p.footprint - p.stored)
                io.pwrite(fd, addr, p.footprint, p.offset)
        if st.config.sync == "data":
            for seg in sorted({p.segment for p in placed} | {m.segment for m in moves}):
                io.fdatasync(files.fd(seg))

    # -- commit ---------------------------------------------------------------------------------------------
    def _commit(self, placed: list[_Pending], batch: _Batch) -> int:
        """One index txn: the batch's entries, the copied records' moves (each only if its block was not deleted
        meanwhile) and the removal of kept records that could not be copied. Returns the records reinserted."""
        st = self._st
        puts = [
            (p.ikey, IndexEntry(p.item.length, p.stored, p.checksum, p.segment, p.offset, p.seq, p.codec))
            for p in placed
        ]
        moves: list[tuple[bytes, int, IndexEntry | None]] = [(m.ikey, m.old.seq, m.entry()) for m in batch.moves]
        moves += [(ikey, seq, None) for ikey, seq in batch.lost]
        with st.mutate:
            with st.lock:
                used = {p.segment for p in placed} | {m.segment for m in batch.moves}
                segs = {seg: st.table.open_seq[seg] for seg in used}
            olds, applied = st.index.commit(puts, segs, moves)
            with st.lock:
                table, c = st.table, st.counters
                reinserted = 0
                for m, ok in zip(batch.moves, applied):
                    if ok:   # else the block was deleted while it was copied: its copy is dead space
                        table.add(m.segment, m.ikey, m.seq, m.footprint)
                        reinserted += 1
                c.reinserted_blocks += reinserted
                c.evicted_blocks += len(batch.lost)
                for p, old in zip(placed, olds):
                    if old is not None:
                        table.remove(old.segment, p.ikey, old.seq, round_up(old.stored_length))
                    table.add(p.segment, p.ikey, p.seq, p.footprint)
                    c.writes += 1
                    c.bytes_written += p.footprint
                    c.raw_bytes += p.item.length
                    c.stored_bytes += p.stored
        batch.dropped += [k for k, _ in batch.lost]
        return reinserted
