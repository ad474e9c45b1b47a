"""The disk tier's index: an lmdb environment holding metadata only (block bytes live in the segment files).

Sub-databases, every value a fixed struct (no pickle)::

    meta        b"format" -> <I version      b"segment_bytes" -> <Q      b"probe" -> <Q (probe() writes it)
    namespaces  name (utf-8) -> <I id        ids are small, stable, never reused
    records     >I namespace id + block key -> ENTRY (length, stored_length, xxh3, segment, offset, seq, codec)
    segments    >I segment -> <Q open_seq    age of the segment's current use (FIFO order, reuse detection)

Record keys start with the big-endian namespace id, so one namespace is one contiguous key range (list_keys,
clear_namespace). lmdb gives one writer and any number of lock-free MVCC readers; this class adds no lock:
the store serializes the write methods. Every lmdb failure is translated here, once, into OSError (ENOSPC when
the filesystem is full, EIO otherwise) so the store handles index and data faults the same way.
"""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, TypeVar

import lmdb

from kvstore.tiers.disk.codec import CODEC_NAMES
from kvstore.tiers.disk.types import DiskRecord

__all__ = ["DiskIndex", "IndexEntry", "FORMAT_VERSION", "make_key", "record_of"]

FORMAT_VERSION = 1
_NS = struct.Struct(">I")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ENTRY = struct.Struct("<QQQIQQB")
MAX_KEY_BYTES = 511 - _NS.size   # lmdb's default maximum key size, less the namespace prefix
_LOW_SPACE = 1 << 20            # a failed commit with less free space than this is reported as ENOSPC


SYNC_INTERVAL_S = 1.0  # longest a committed batch entry waits for its index flush (power loss only)
_T = TypeVar("_T")


class IndexEntry(NamedTuple):
    length: int
    stored_length: int
    checksum: int
    segment: int
    offset: int
    seq: int
    codec: int

    def pack(self) -> bytes:
        return _ENTRY.pack(*self)

    @staticmethod
    def unpack(raw: bytes | memoryview) -> IndexEntry:
        return IndexEntry(*_ENTRY.unpack(raw))


def make_key(ns_id: int, key: bytes) -> bytes:
    return _NS.pack(ns_id) + key


def split_key(ikey: bytes) -> tuple[int, bytes]:
    return _NS.unpack_from(ikey)[0], ikey[_NS.size:]


class DiskIndex:
    def __init__(self, directory: str, *, map_size: int, sync: bool) -> None:
        self.directory = directory
        self.map_size = map_size
        self.sync = sync
        self._last_sync = time.monotonic()
        self.readonly = False
        self._env: lmdb.Environment | None = None
        self._ns: dict[str, int] = {}
        self._ns_names: dict[int, str] = {}

    # -- lifecycle ------------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return os.path.exists(os.path.join(self.directory, "data.mdb"))

    def open(self, *, readonly: bool) -> None:
        try:
            env = lmdb.open(
                self.directory, map_size=self.map_size, subdir=True, max_dbs=4, readonly=readonly,
                create=not readonly, sync=False, metasync=False, writemap=False, readahead=False,
                meminit=False, mode=0o600, max_readers=256,
            )
            dbs = {}
            for name in (b"meta", b"namespaces", b"records", b"segments"):
                if readonly:
                    with env.begin() as txn:
                        if txn.get(name) is None:
                            raise lmdb.NotFoundError(f"sub-database {name.decode()} is missing")
                dbs[name] = env.open_db(name, create=not readonly)
        except lmdb.Error as exc:
            raise self._os_error("open the index", exc) from exc
        self._env, self.readonly = env, readonly
        self._meta, self._nsdb = dbs[b"meta"], dbs[b"namespaces"]
        self._rec, self._segdb = dbs[b"records"], dbs[b"segments"]
        with env.begin() as txn:
            for raw_name, raw_id in txn.cursor(db=self._nsdb):
                self._remember(bytes(raw_name).decode(), _U32.unpack(raw_id)[0])

    def close(self) -> None:
        if self._env is not None:
            if self.sync and not self.readonly:
                try:
                    self._env.sync(True)  # a clean shutdown leaves nothing to the interval flush
                except lmdb.Error:
                    pass  # a failing disk: close anyway; the data files were synced batch by batch
            self._env.close()
            self._env = None
        self._ns.clear()
        self._ns_names.clear()

    def _remember(self, name: str, ns_id: int) -> None:
        self._ns[name] = ns_id
        self._ns_names[ns_id] = name

    def _os_error(self, what: str, exc: lmdb.Error) -> OSError:
        code = errno.EIO
        if isinstance(exc, lmdb.MapFullError):
            code = errno.ENOSPC
        else:
            try:
                st = os.statvfs(self.directory)
                if st.f_bavail * st.f_frsize < _LOW_SPACE:
                    code = errno.ENOSPC   # lmdb reports a short write on a full filesystem as EIO
            except OSError:
                pass
        return OSError(code, f"index (lmdb) could not {what}: {exc}", self.directory)

    def _env_or_fail(self) -> lmdb.Environment:
        if self._env is None:
            raise RuntimeError("the disk index is closed: call DiskStore.open() first")
        return self._env

    def _write(self, what: str, fn: Callable[[lmdb.Transaction], _T], *, durable: bool = False) -> _T:
        """Run fn(txn) in one write transaction and commit it; lmdb errors become OSError.

        lmdb runs without its own per-commit flush: a committed transaction is in the page cache at once, so
        it survives a crash of the process (SIGKILL) as is. With sync on, the index is flushed at most every
        `SYNC_INTERVAL_S` for ordinary commits (so a batch pays one flush, its data's, not two): a power loss
        may undo the commits of that last interval, which for batches of new entries only turns them into
        misses (their data was synced before they were committed). `durable` commits (reclaiming a segment,
        deletes, the format) are flushed completely before returning: a reclaimed segment is about to be
        overwritten, and a deleted block must not come back.
        """
        if self.readonly:
            raise OSError(errno.EROFS, f"index could not {what}: it is open read-only", self.directory)
        try:
            env = self._env_or_fail()
            with env.begin(write=True) as txn:
                out = fn(txn)
            if self.sync and (durable or time.monotonic() - self._last_sync >= SYNC_INTERVAL_S):
                env.sync(True)
                self._last_sync = time.monotonic()
            return out
        except lmdb.Error as exc:
            raise self._os_error(what, exc) from exc

    # -- format -------------------------------------------------------------------------------------------
    def format_info(self) -> tuple[int | None, int | None]:
        """(format version, segment_bytes) as stored; (None, None) for a new index."""
        with self._env_or_fail().begin(db=self._meta) as txn:
            fmt, seg = txn.get(b"format"), txn.get(b"segment_bytes")
        return (_U32.unpack(fmt)[0] if fmt else None, _U64.unpack(seg)[0] if seg else None)

    def write_format(self, segment_bytes: int) -> None:
        def put(txn: lmdb.Transaction) -> None:
            txn.put(b"format", _U32.pack(FORMAT_VERSION), db=self._meta)
            txn.put(b"segment_bytes", _U64.pack(segment_bytes), db=self._meta)

        self._write("record the format", put, durable=True)

    def touch(self, value: int) -> None:
        """A tiny committed write: probe() uses it to check that the index can commit again."""
        self._write("commit a probe", lambda txn: txn.put(b"probe", _U64.pack(value), db=self._meta))

    # -- namespaces ---------------------------------------------------------------------------------------
    def ns_id(self, name: str) -> int | None:
        return self._ns.get(name)

    def ns_name(self, ns_id: int) -> str:
        return self._ns_names.get(ns_id, f"#{ns_id}")

    def ensure_namespace(self, name: str) -> int:
        ns_id = self._ns.get(name)
        if ns_id is not None:
            return ns_id
        ns_id = max(self._ns_names, default=0) + 1
        self._write(
            "add a namespace", lambda txn: txn.put(name.encode(), _U32.pack(ns_id), db=self._nsdb), durable=True
        )
        self._remember(name, ns_id)
        return ns_id

    def namespaces_with_records(self) -> list[str]:
        out = []
        with self._env_or_fail().begin(db=self._rec) as txn:
            cur = txn.cursor()
            for name, ns_id in sorted(self._ns.items()):
                prefix = _NS.pack(ns_id)
                if cur.set_range(prefix) and bytes(cur.key()).startswith(prefix):
                    out.append(name)
        return out

    # -- reads (any thread; each call is one read transaction) --------------------------------------------
    def get(self, ikey: bytes) -> IndexEntry | None:
        with self._env_or_fail().begin(db=self._rec) as txn:
            raw = txn.get(ikey)
        return IndexEntry.unpack(raw) if raw is not None else None

    def get_many(self, ikeys: Sequence[bytes]) -> list[IndexEntry | None]:
        with self._env_or_fail().begin(db=self._rec) as txn:
            raws = [txn.get(k) for k in ikeys]
        return [IndexEntry.unpack(r) if r is not None else None for r in raws]

    def scan(self, ns_id: int, after: bytes, limit: int) -> list[tuple[bytes, IndexEntry]]:
        """Up to `limit` (block key, entry) of one namespace with block key > `after`, in key order."""
        prefix = _NS.pack(ns_id)
        out: list[tuple[bytes, IndexEntry]] = []
        with self._env_or_fail().begin(db=self._rec) as txn:
            cur = txn.cursor()
            if not cur.set_range(prefix + after):
                return out
            for k, v in cur:
                k = bytes(k)
                if not k.startswith(prefix):
                    break
                key = k[_NS.size:]
                if key == after:
                    continue
                out.append((key, IndexEntry.unpack(v)))
                if len(out) >= limit:
                    break
        return out

    def all_entries(self) -> list[tuple[bytes, IndexEntry]]:
        with self._env_or_fail().begin(db=self._rec) as txn:
            return [(bytes(k), IndexEntry.unpack(v)) for k, v in txn.cursor()]

    def segment_seqs(self) -> dict[int, int]:
        with self._env_or_fail().begin(db=self._segdb) as txn:
            return {_NS.unpack(k)[0]: _U64.unpack(v)[0] for k, v in txn.cursor()}

    # -- writes (one committed transaction each; the caller serializes them) ------------------------------
    def commit(
        self, puts: Sequence[tuple[bytes, IndexEntry]], segments: dict[int, int],
        moves: Sequence[tuple[bytes, int, IndexEntry | None]] = (),
    ) -> tuple[list[IndexEntry | None], list[bool]]:
        """Put every entry and the open_seq of the segments they live in, in ONE txn; returns the entries the
        puts replaced, and for each move (key, expected seq, new entry or None) whether it was applied: a move
        replaces (None: deletes) the entry only while it is still the version `expected seq`."""

        def body(txn: lmdb.Transaction) -> tuple[list[IndexEntry | None], list[bool]]:
            for seg, seq in segments.items():
                txn.put(_NS.pack(seg), _U64.pack(seq), db=self._segdb)
            moved = []
            for ikey, expected, entry in moves:
                raw = txn.get(ikey, db=self._rec)
                ok = raw is not None and IndexEntry.unpack(raw).seq == expected
                if ok and entry is not None:
                    txn.put(ikey, entry.pack(), db=self._rec)
                elif ok:
                    txn.delete(ikey, db=self._rec)
                moved.append(ok)
            olds = []
            for ikey, entry in puts:
                old = txn.replace(ikey, entry.pack(), db=self._rec)
                olds.append(IndexEntry.unpack(old) if old is not None else None)
            return olds, moved

        return self._write("commit a batch", body)

    def delete(self, ikeys: Iterable[bytes]) -> list[tuple[bytes, IndexEntry]]:
        """Delete these keys; returns the (key, entry) pairs that existed."""

        def body(txn: lmdb.Transaction) -> list[tuple[bytes, IndexEntry]]:
            out: list[tuple[bytes, IndexEntry]] = []
            for ikey in ikeys:
                old = txn.pop(ikey, db=self._rec)
                if old is not None:
                    out.append((ikey, IndexEntry.unpack(old)))
            return out

        return self._write("delete entries", body, durable=True)

    def delete_if(self, ikey: bytes, seq: int) -> IndexEntry | None:
        """Delete one entry only if it is still the version `seq` (a newer write of the key is kept)."""

        def body(txn: lmdb.Transaction) -> IndexEntry | None:
            raw = txn.get(ikey, db=self._rec)
            if raw is None:
                return None
            entry = IndexEntry.unpack(raw)
            if entry.seq != seq:
                return None
            txn.delete(ikey, db=self._rec)
            return entry

        return self._write("drop an entry", body)

    def reclaim(self, segment: int, open_seq: int, ikeys: Iterable[bytes]) -> list[tuple[bytes, IndexEntry]]:
        """Delete every listed entry that still lives in `segment` and record its new open_seq, in ONE txn.

        Entries of the segment left out of `ikeys` (records being reinserted) stay, but with a seq below the new
        open_seq they are stale: readers and recovery treat them as gone until a move (commit) replaces them."""

        def body(txn: lmdb.Transaction) -> list[tuple[bytes, IndexEntry]]:
            out: list[tuple[bytes, IndexEntry]] = []
            for ikey in ikeys:
                raw = txn.get(ikey, db=self._rec)
                if raw is None:
                    continue
                entry = IndexEntry.unpack(raw)
                if entry.segment == segment:
                    txn.delete(ikey, db=self._rec)
                    out.append((ikey, entry))
            txn.put(_NS.pack(segment), _U64.pack(open_seq), db=self._segdb)
            return out

        return self._write("reclaim a segment", body, durable=True)

    def delete_namespace(self, ns_id: int) -> list[tuple[bytes, IndexEntry]]:
        prefix = _NS.pack(ns_id)

        def body(txn: lmdb.Transaction) -> list[tuple[bytes, IndexEntry]]:
            out: list[tuple[bytes, IndexEntry]] = []
            cur = txn.cursor(db=self._rec)
            if not cur.set_range(prefix):
                return out
            while bytes(cur.key()).startswith(prefix):
                out.append((bytes(cur.key()), IndexEntry.unpack(cur.value())))
                if not cur.delete():
                    break
            return out

        return self._write("clear a namespace", body, durable=True)


def record_of(namespace: str, key: bytes, e: IndexEntry) -> DiskRecord:
    """The public record of an index entry (DiskStore.lookup, list_keys)."""
    return DiskRecord(
        namespace=namespace, key=key, length=e.length, stored_length=e.stored_length, checksum=e.checksum,
        segment=e.segment, offset=e.offset, seq=e.seq, codec=CODEC_NAMES.get(e.codec, f"#{e.codec}"),
    )
