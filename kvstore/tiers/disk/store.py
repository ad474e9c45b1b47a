"""DiskStore: the disk tier's public facade. It stores whole blocks; the engine decides what goes there.

Primitives and what they return (statuses are DiskStatus; exceptions are for bugs and misconfiguration):

- open(wipe=False) -> RecoveryReport: create, or recover and validate (see recovery.py). ConfigError when the
  directory was made with another segment_bytes / format, is locked by another process, or cannot be created.
  A directory on a read-only filesystem opens read-only: reads work, the store is degraded until probe().
- write_many(items) -> [OK | NO_SPACE | IO_ERROR | DEGRADED]: one batch = pwrites, one fdatasync per touched file,
  ONE index commit (writer.py). An existing key is replaced. A fault fails the batch and degrades the store.
  When it needs space it reclaims the oldest segment, keeping the records that were read (reclaim.py).
  write_batch(items) -> WriteResult: the same, plus which blocks those reclamations dropped and how many
  records they kept (the engine publishes the dropped ones as removed from the disk tier).
- read_into(ns, key, address, capacity) -> (OK | NOT_FOUND | CHECKSUM_ERROR | IO_ERROR, length) (reader.py).
- read_stream(next_item, done): read_into for a stream of items, verifying each during the next read (read_stream.py).
- lookup / contains_many / list_keys / namespaces: index only, no data I/O.
- delete / clear_namespace -> count removed (0 when the index cannot commit: the store degrades).
- probe() -> bool: write, sync and read back a page in a spare file, commit a tiny index txn, make the next
  segment ready; clears degraded on success (degrades on failure).
- stats(), degraded, close().

Thread-safety and lock order: see state.py. write_many calls are serialized; read_into, lookups, deletes and
stats may run from any threads concurrently with it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.tiers.disk.config import DiskConfig
from kvstore.tiers.disk.counters import DiskCounters
from kvstore.tiers.disk.directory import StoreDirectory
from kvstore.tiers.disk.floors import TenantFloors
from kvstore.tiers.disk.health import Health
from kvstore.tiers.disk.index import FORMAT_VERSION, DiskIndex, IndexEntry, make_key, record_of
from kvstore.tiers.disk.io import BlockIO
from kvstore.tiers.disk.read_stream import R, read_stream
from kvstore.tiers.disk.reader import BlockReader
from kvstore.tiers.disk.recovery import recover
from kvstore.tiers.disk.segments import SegmentFiles, SegmentTable, segment_name
from kvstore.tiers.disk.state import StoreState
from kvstore.tiers.disk.types import DiskRecord, DiskStats, DiskStatus, RecoveryReport, WriteItem, WriteResult
from kvstore.tiers.disk.writer import BatchWriter, check_items

__all__ = ["DiskStore"]

log = logging.getLogger("kvstore.tiers.disk")


class DiskStore:
    def __init__(self, config: DiskConfig, io: BlockIO | None = None) -> None:
        self.config = config
        self._io = io if io is not None else BlockIO()
        self._writer_lock, self._mutate, self._lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._st: StoreState | None = None
        self._writer: BatchWriter | None = None
        self._reader: BlockReader | None = None
        self._dir = StoreDirectory(config.directory)
        self._pending_drops: list[bytes] = []   # invalid entries found while read-only, dropped once writable
        self._probe_count = 0
        self._floors: TenantFloors | None = None
        self._resident: Callable[[list[tuple[str, bytes]]], list[bool]] | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------
    def open(self, *, wipe: bool = False) -> RecoveryReport:
        with self._writer_lock:
            if self._st is not None:
                raise RuntimeError(f"disk store at {self.config.directory} is already open")
            t0 = time.monotonic()
            writable = self._dir.prepare()
            index = DiskIndex(self.config.directory, map_size=self.config.index_map_size,
                              sync=self.config.sync == "data")
            try:
                created = self._open_index(index, writable, wipe)
                st = self._build_state(index, writable)
                found = recover(st, writable=writable)
            except OSError as exc:
                index.close()
                self._dir.release()
                raise ConfigError(
                    f"cannot open the disk store in {self.config.directory}: {exc.strerror or exc}; fix the directory "
                    "or open it with wipe=True (the daemon's disk wipe option) to start afresh"
                ) from exc
            except BaseException:
                index.close()
                self._dir.release()
                raise
            self._pending_drops = [] if writable else found.dropped
            st.counters.dropped_entries += len(found.dropped)
            if not writable:
                st.health.read_only(OSError(errno.EROFS, os.strerror(errno.EROFS), self.config.directory))
            elif st.table.active is not None:
                try:   # re-preallocate the segment appends continue in (a no-op unless it was truncated)
                    st.files.prepare(st.table.active)
                except OSError as exc:
                    st.health.fault("preallocating the active segment", exc)
            self._st, self._writer, self._reader = st, BatchWriter(st), BlockReader(st)
            return self._report(st, created, wipe, found.dropped, found.removed_files, time.monotonic() - t0)

    def _open_index(self, index: DiskIndex, writable: bool, wipe: bool) -> bool:
        """Wipe if asked, open (or create) the index, check its format. Returns whether it was created."""
        cfg = self.config
        if wipe:
            if not writable:
                raise ConfigError(f"cannot wipe disk directory {cfg.directory}: its filesystem is read-only")
            self._dir.wipe()
        created = not index.exists()
        if created and not writable:
            raise ConfigError(
                f"disk directory {cfg.directory} is not writable and holds no store: make it writable or choose "
                "another directory"
            )
        index.open(readonly=not writable)
        self._check_format(index)
        if created and cfg.sync == "data":
            self._io.sync_directory(cfg.directory)
        return created

    def _report(
        self, st: StoreState, created: bool, wiped: bool, dropped: list[bytes], removed: int, elapsed: float
    ) -> RecoveryReport:
        cfg, table = self.config, st.table
        report = RecoveryReport(
            created=created, wiped=wiped, blocks=table.blocks, bytes=table.used_bytes,
            namespaces=len(st.index.namespaces_with_records()), segments_in_use=cfg.segments - len(table.free),
            dropped_entries=len(dropped), removed_files=removed, read_only=not st.files.writable, elapsed_s=elapsed,
        )
        log.info(
            "disk tier at %s: %s, %d blocks (%d bytes) in %d of %d segments, %d entries dropped, direct I/O %s",
            cfg.directory, "created" if created else "recovered", report.blocks, report.bytes,
            report.segments_in_use, cfg.segments, report.dropped_entries, "on" if self._io.direct else "off",
        )
        return report

    def close(self) -> None:
        """Wait for in-flight reads, then close files and index. Later reads answer NOT_FOUND; other calls raise."""
        with self._writer_lock:
            st = self._st
            if st is None:
                return
            with st.lock:
                st.pause_reads()
            with st.mutate, st.lock:
                st.closed = True
                self._st = None
                st.files.close_all()
                st.index.close()
                st.resume_reads()
            assert self._writer is not None and self._reader is not None
            self._writer.close()
            self._reader.close()
            self._dir.release()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_format(self, index: DiskIndex) -> None:
        cfg = self.config
        fmt, seg = index.format_info()
        if fmt is None and seg is None:
            if not index.readonly:
                index.write_format(cfg.segment_bytes)
            return
        if fmt != FORMAT_VERSION:
            raise ConfigError(
                f"disk store in {cfg.directory} has format version {fmt}, this build reads version {FORMAT_VERSION}: "
                "open it with wipe=True (the daemon's disk wipe option) to erase it, or use a matching kvstore"
            )
        if seg != cfg.segment_bytes:
            raise ConfigError(
                f"disk store in {cfg.directory} was created with segment_bytes={seg}, but the config says "
                f"{cfg.segment_bytes}: set segment_bytes={seg} to keep the cached blocks, or open it with wipe=True "
                "(the daemon's disk wipe option) to erase them and start with the new size"
            )

    def _build_state(self, index: DiskIndex, writable: bool) -> StoreState:
        cfg = self.config
        files = SegmentFiles(cfg.directory, cfg.segment_bytes, self._io, sync=cfg.sync == "data", writable=writable)
        st = StoreState(
            cfg, self._io, files, SegmentTable(cfg.segments, cfg.segment_bytes), index,
            Health(cfg.directory, cfg.probe_interval_s), DiskCounters(), self._writer_lock, self._mutate, self._lock,
        )
        st.floors, st.resident = self._floors, self._resident
        return st

    def set_resident(self, resident: Callable[[list[tuple[str, bytes]]], list[bool]] | None) -> None:
        """Which records back a RAM copy (reclaim.py: no second chance for those); called holding only `writer`."""
        self._resident = resident
        self._attach()

    def set_floors(self, floors: TenantFloors | None) -> None:
        """Per-tenant disk quotas (floors.py): enforced from the next segment reclamation on."""
        self._floors = floors
        self._attach()

    def _attach(self) -> None:
        if self._st is not None:
            self._st.floors, self._st.resident = self._floors, self._resident

    def namespace_bytes(self) -> dict[str, int]:
        """Footprint on disk (page-rounded stored bytes of live records) per namespace that holds any."""
        st = self._state()
        with st.lock:
            held = dict(st.table.ns_bytes)
        return {st.index.ns_name(ns): n for ns, n in held.items()}

    def _state(self) -> StoreState:
        return self._st or self._not_open()

    def _not_open(self) -> NoReturn:
        raise RuntimeError(f"disk store at {self.config.directory} is not open: call open() first")

    # -- writes ---------------------------------------------------------------------------------------------
    def write_many(self, items: Sequence[WriteItem]) -> list[DiskStatus]:
        """Store each block; see writer.py. Returns one status per item, in order."""
        return self.write_batch(items).statuses

    def write_batch(self, items: Sequence[WriteItem]) -> WriteResult:
        """write_many, also telling which blocks the batch's segment reclamations dropped or kept."""
        if not items:
            return WriteResult([])
        check_items(items, self.config.segment_bytes, self.config.compression)
        with self._writer_lock:
            st = self._state()
            with st.lock:
                if st.health.degraded:
                    return WriteResult([DiskStatus.DEGRADED] * len(items))
            assert self._writer is not None
            return self._writer.write_many(items)

    def delete(self, namespace: str, keys: Sequence[bytes]) -> int:
        st = self._state()
        ns_id = st.index.ns_id(namespace)
        if ns_id is None or not keys:
            return 0
        return self._remove(st, "deleting blocks", lambda: st.index.delete([make_key(ns_id, bytes(k)) for k in keys]))

    def clear_namespace(self, namespace: str) -> int:
        st = self._state()
        ns_id = st.index.ns_id(namespace)
        if ns_id is None:
            return 0
        return self._remove(st, "clearing a namespace", lambda: st.index.delete_namespace(ns_id))

    def _remove(self, st: StoreState, what: str, txn: Callable[[], list[tuple[bytes, IndexEntry]]]) -> int:
        if st.index.readonly:
            return 0
        try:
            with st.mutate:
                removed = txn()
                with st.lock:
                    st.forget(removed)
        except OSError as exc:
            with st.lock:
                st.health.fault(what, exc)
            return 0
        return len(removed)

    # -- reads ----------------------------------------------------------------------------------------------
    def read_into(self, namespace: str, key: bytes, address: int, capacity: int) -> tuple[DiskStatus, int]:
        """Read a block into `address` (page-aligned, `capacity` bytes); see reader.py."""
        return (self._reader or self._not_open()).read_into(namespace, key, address, capacity)

    def read_stream(self, next_item: Callable[[], R | None], done: Callable[[R, DiskStatus, int], None]) -> None:
        read_stream(self._reader or self._not_open(), next_item, done)

    def lookup(self, namespace: str, key: bytes) -> DiskRecord | None:
        st = self._state()
        with st.lock:
            ns_id = st.index.ns_id(namespace)
            entry = st.index.get(make_key(ns_id, bytes(key))) if ns_id is not None else None
        return record_of(namespace, bytes(key), entry) if entry is not None else None

    def contains_many(self, namespace: str, keys: Sequence[bytes]) -> list[int]:
        """Length of each block, 0 when absent; one read transaction."""
        st = self._state()
        with st.lock:
            ns_id = st.index.ns_id(namespace)
            if ns_id is None:
                return [0] * len(keys)
            entries = st.index.get_many([make_key(ns_id, bytes(k)) for k in keys])
        return [e.length if e is not None else 0 for e in entries]

    def list_keys(self, namespace: str, cursor: bytes, limit: int) -> tuple[list[DiskRecord], bytes]:
        """Records with key > cursor (b"" starts), in key order; the next cursor, b"" when the listing is done."""
        if not isinstance(limit, int) or limit < 1:
            raise InvalidRequestError(f"list limit {limit!r} must be a positive integer")
        st = self._state()
        with st.lock:
            ns_id = st.index.ns_id(namespace)
            found = st.index.scan(ns_id, bytes(cursor), limit + 1) if ns_id is not None else []
        records = [record_of(namespace, k, e) for k, e in found[:limit]]
        return records, (records[-1].key if len(found) > limit else b"")

    def namespaces(self) -> list[str]:
        """Namespaces that hold at least one block, sorted."""
        st = self._state()
        with st.lock:
            return st.index.namespaces_with_records()

    # -- health ---------------------------------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        st = self._st
        return st is not None and st.health.degraded

    def probe(self) -> bool:
        """Try the disk: write+sync+read a page in a spare file, commit an index txn, ready the next segment."""
        with self._writer_lock:
            st = self._state()
            try:
                self._dir.probe_page(self._io)
                if st.index.readonly:
                    self._become_writable(st)
                self._probe_count += 1
                with st.mutate:
                    st.index.touch(self._probe_count)
                self._ready_segment(st)
            except OSError as exc:
                with st.lock:
                    if st.health.degraded:
                        log.debug("disk probe of %s failed: %s", self.config.directory, exc)
                    st.health.fault("probe", exc)
                return False
            with st.lock:
                st.health.recovered()
            return True

    def _become_writable(self, st: StoreState) -> None:
        """The filesystem accepts writes again: reopen the index and the segment files read-write."""
        with st.lock:
            st.pause_reads()
        try:
            with st.mutate, st.lock:
                st.index.close()
                try:
                    st.index.open(readonly=False)
                except OSError:
                    st.index.open(readonly=True)
                    raise
                st.files.close_all()
                st.files.writable = True
                drops, self._pending_drops = self._pending_drops, []
        finally:
            with st.lock:
                st.resume_reads()
        if drops:
            with st.mutate:
                st.index.delete(drops)
        if not self._dir.locked:
            self._dir.take_lock(create=True)

    def _ready_segment(self, st: StoreState) -> None:
        """When no segment is active, prepare a free one now, so a full filesystem keeps the store degraded."""
        with st.lock:
            if st.table.active is not None:
                return
            seg = st.table.take_free()
            if seg is None:
                return      # the next write reclaims the oldest segment: no new space is needed
            st.table.reset(seg, st.alloc_seq())
        try:
            st.files.prepare(seg)
        except OSError:
            with st.lock:
                st.table.release(seg)
            raise
        with st.lock:
            st.table.activate(seg)

    # -- stats ----------------------------------------------------------------------------------------------
    def stats(self) -> DiskStats:
        st = self._state()
        cfg = self.config
        with st.lock:
            c, t, h = st.counters, st.table, st.health
            return DiskStats(
                capacity_bytes=cfg.effective_capacity, used_bytes=t.used_bytes, blocks=t.blocks,
                segments_total=cfg.segments, segments_free=len(t.free), degraded=h.degraded,
                degraded_reason=h.reason, bytes_written=c.bytes_written, bytes_read=c.bytes_read,
                raw_bytes=c.raw_bytes, stored_bytes=c.stored_bytes,
                checksum_failures=c.checksum_failures, io_errors=c.io_errors, evicted_blocks=c.evicted_blocks,
                evicted_bytes=c.evicted_bytes, reads=c.reads, writes=c.writes, dropped_entries=c.dropped_entries,
                direct_io=self._io.direct, reinserted_blocks=c.reinserted_blocks,
                quota_kept_blocks=c.quota_kept_blocks, quota_overcommitted=c.quota_overcommitted,
                cleaned_segments=c.cleaned_segments)

    def segment_path(self, segment: int) -> str:
        """Path of a segment file (for tools and tests)."""
        return os.path.join(self.config.directory, segment_name(segment))

