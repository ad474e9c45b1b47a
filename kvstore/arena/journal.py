"""The RAM journal: a header for every committed slot, kept in a memory file only the daemon holds.

Why: the arena's bytes live in memfds that outlive a daemon process when something else holds them (its
successor during a hand-over restart, systemd's file descriptor store across a crash). Bytes alone are not a
cache: the next process must know which key each slot holds, and check it before serving a byte. The journal
says so, slot by slot, in a file of its own (never handed to a client: a tenant that could write headers could
make another tenant's key name its own bytes).

Layout (one memfd, sparse: only the pages written hold memory; little-endian throughout)::

    [ header page ][ slab domains: u32 a slab ][ domains: 1 KiB each ][ namespaces: 2 KiB each ][ entries ]

* header: magic, format version, record size and the arena's geometry; a reader refuses a file whose
  geometry or format differs from its own (JournalMismatch says why: the daemon then starts cold).
* slab domains: which memory file (domain index + 1; 0 = the shared one) backs each slab (arena/backing.py).
* domains: index -> tenant name, as [u64 xxh3][u32 length][utf-8].
* namespaces: namespace id -> its description as [u64 xxh3][u32 length][JSON] (names, labels, codec,
  tokens_per_block; ids are the catalog's, which the entries name).
* entries: one 128-byte record per catalog entry id::

      0 live (RECORD_LIVE or 0)   8 hash   16 offset   24 size   32 generation   40 checksum (xxh3_64 of the
      block, 0 = unknown)   48 serial u32   52 namespace u16   54 key length u8   55 flags u8   56 key (64)
      120 reserved

  `hash` mixes every word after it (record_hash: vectorized, an integrity check against a torn or damaged
  header, not a MAC: only the daemon and its successor hold the file). A record is written with `live` 0 and
  made live last; it is cleared by zeroing `live` first. A process killed anywhere in between leaves a record
  that reads as absent or as whole. The generation is the slot's generation word when the record was written:
  every free of the slot bumps that word (arena/layout.py), so a record of a slot freed since never verifies.

What the journal does not say is trusted: verify.py checks each record against the arena (generation, slot
geometry, the block's xxh3) before an entry is adopted.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from kvstore.arena.layout import ArenaLayout

__all__ = ["RamJournal", "JournalMismatch", "JournalEntries", "ENTRY_DTYPE", "RECORD_LIVE", "FORMAT_VERSION",
           "record_hash", "MAX_KEY"]

FORMAT_VERSION = 1
RECORD_BYTES = 128
MAX_KEY = 64
RECORD_LIVE = 0x5952544E45535653  # "SVSENTRY" little-endian: a record that says something
_MAGIC = 0x314C4E524A53564B       # "KVSJRNL1"
_HEADER = struct.Struct("<QIIQQQQQQQ")  # magic, format, record bytes, n_slabs, slab, page, data offset, caps x3
_PAGE = 4096
_DOMAIN_BYTES = 1024
_NS_BYTES = 2048
MAX_DOMAINS = 4096
MAX_NAMESPACES = 65536
_BLOB = struct.Struct("<QI")  # xxh3 of the payload, payload length
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

ENTRY_DTYPE = np.dtype([("live", "<u8"), ("hash", "<u8"), ("offset", "<u8"), ("size", "<u8"), ("gen", "<u8"),
                        ("checksum", "<u8"), ("serial", "<u4"), ("ns", "<u2"), ("keylen", "u1"), ("flags", "u1"),
                        ("key", "u1", (MAX_KEY,)), ("reserved", "<u8")])
assert ENTRY_DTYPE.itemsize == RECORD_BYTES

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLD = 0x9E3779B97F4A7C15
_WORDS = RECORD_BYTES // 8 - 2  # the words the hash covers (after live and hash)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def record_hash(records: np.ndarray) -> np.ndarray:
    """The hash word of each record (a structured ENTRY_DTYPE array): every word after `hash`, mixed in order."""
    words = np.ascontiguousarray(records).view(np.uint64).reshape(len(records), RECORD_BYTES // 8)[:, 2:]
    h = np.full(len(records), np.uint64(0x6B7673746F726531), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(_WORDS):
            h = _mix(h ^ (words[:, i] + np.uint64((i * _GOLD) & 0xFFFF_FFFF_FFFF_FFFF)))
    return h


class JournalMismatch(Exception):
    """A journal this daemon cannot read as its own (another format or arena geometry): start cold, say why."""


@dataclass(frozen=True)
class JournalEntries:
    """The live records whose header hash holds (ids ascending), and how many live ones did not."""

    eids: np.ndarray
    records: np.ndarray  # ENTRY_DTYPE, one per eid
    bad_headers: int
    bad_eids: np.ndarray | None = None  # the live records whose header failed (a successor clears them)

    def keys(self) -> list[bytes]:
        """Each record's key (raw bytes: trailing zero bytes are part of a key)."""
        raw = np.ascontiguousarray(self.records["key"]).tobytes()
        return [raw[i * MAX_KEY: i * MAX_KEY + n] for i, n in enumerate(self.records["keylen"].tolist())]


class RamJournal:
    """One journal file. Writers call it under the engine's lock (engine/journal_link.py); not thread-safe."""

    def __init__(self, fd: int, layout: ArenaLayout) -> None:
        """Map an existing journal file `fd` (owned from now on). Use `create` or `open`."""
        self.fd = fd
        self.layout = layout
        self.capacity = layout.data_bytes // layout.page_bytes  # at most one entry per page of data
        self._slabs_at = _PAGE
        self._domains_at = _round(self._slabs_at + 4 * layout.n_slabs)
        self._ns_at = self._domains_at + MAX_DOMAINS * _DOMAIN_BYTES
        self._entries_at = self._ns_at + MAX_NAMESPACES * _NS_BYTES
        self.size = _round(self._entries_at + self.capacity * RECORD_BYTES)
        self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.entries = np.frombuffer(self._mm, dtype=ENTRY_DTYPE, count=self.capacity, offset=self._entries_at)
        self._slab_domains = np.frombuffer(self._mm, dtype="<u4", count=layout.n_slabs, offset=self._slabs_at)

    @classmethod
    def create(cls, layout: ArenaLayout) -> RamJournal:
        """A new, empty journal for an arena of this geometry (sealed against resizing, like the arena files)."""
        fd = os.memfd_create(f"kvstore-journal-{layout.name}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, cls._size_for(layout))
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            j = cls(fd, layout)
        except BaseException:
            os.close(fd)
            raise
        _HEADER.pack_into(j._mm, 0, _MAGIC, FORMAT_VERSION, RECORD_BYTES, layout.n_slabs, layout.slab_bytes,
                          layout.page_bytes, layout.data_offset, j.capacity, MAX_DOMAINS, MAX_NAMESPACES)
        j.set_domain(0, "")  # domain 0 is the shared file (arena/backing.py SHARED_DOMAIN)
        return j

    @classmethod
    def open(cls, fd: int, layout: ArenaLayout) -> RamJournal:
        """The journal in `fd` (owned from now on), if it describes an arena of this geometry in this format;
        JournalMismatch (fd closed) says why not."""
        try:
            head = os.pread(fd, _HEADER.size, 0)
            if len(head) < _HEADER.size:
                raise JournalMismatch(f"the journal file is {len(head)} bytes, shorter than its header")
            magic, fmt, rec, n_slabs, slab, page, data_off, _, _, _ = _HEADER.unpack(head)
            if magic != _MAGIC:
                raise JournalMismatch("the file handed over as the journal is not a kvstore RAM journal")
            if fmt != FORMAT_VERSION or rec != RECORD_BYTES:
                raise JournalMismatch(f"journal format {fmt} (records of {rec} bytes); this daemon reads format "
                                      f"{FORMAT_VERSION} ({RECORD_BYTES} bytes)")
            mine = (layout.n_slabs, layout.slab_bytes, layout.page_bytes, layout.data_offset)
            if (n_slabs, slab, page, data_off) != mine:
                raise JournalMismatch(
                    f"the arena was {n_slabs} slabs of {slab} bytes (pages {page}, data at {data_off}); this "
                    f"daemon's is {mine[0]} slabs of {mine[1]} bytes (pages {mine[2]}, data at {mine[3]}): "
                    "arena_bytes or max_block_bytes changed")
            if os.fstat(fd).st_size < cls._size_for(layout):
                raise JournalMismatch("the journal file is shorter than its geometry needs")
            return cls(fd, layout)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _size_for(layout: ArenaLayout) -> int:
        capacity = layout.data_bytes // layout.page_bytes
        entries_at = _round(_PAGE + 4 * layout.n_slabs) + MAX_DOMAINS * _DOMAIN_BYTES + MAX_NAMESPACES * _NS_BYTES
        return _round(entries_at + capacity * RECORD_BYTES)

    # -- entries ------------------------------------------------------------------------------------------
    def write_entries(self, eids: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, gens: np.ndarray,
                      checksums: np.ndarray, serials: np.ndarray, ns_ids: np.ndarray, keys: list[bytes]) -> None:
        """Records for these entries (ids distinct), each written whole and then made live."""
        if not len(eids):
            return
        ids = np.asarray(eids, dtype=np.int64)
        rec = np.zeros(len(ids), dtype=ENTRY_DTYPE)
        rec["offset"], rec["size"], rec["gen"] = offsets, sizes, gens
        rec["checksum"], rec["serial"], rec["ns"] = checksums, serials, ns_ids
        rec["keylen"] = [len(k) for k in keys]
        rec["key"] = np.frombuffer(b"".join(k.ljust(MAX_KEY, b"\0") for k in keys), dtype=np.uint8).reshape(-1, MAX_KEY)
        rec["hash"] = record_hash(rec)
        self.entries["live"][ids] = 0  # a reader never sees half a record as live
        self.entries[ids] = rec
        self.entries["live"][ids] = RECORD_LIVE

    def clear_entries(self, eids: np.ndarray | list[int]) -> None:
        """These entries no longer say anything (evicted, deleted, reused)."""
        if len(eids):
            self.entries["live"][np.asarray(eids, dtype=np.int64)] = 0

    def clear_all(self) -> None:
        self.entries["live"][:] = 0

    def scan(self) -> JournalEntries:
        """Every live record whose header hash holds; the others are counted (a damaged or torn header)."""
        live = np.flatnonzero(self.entries["live"] == RECORD_LIVE)
        rec = self.entries[live].copy()
        ok = record_hash(rec) == rec["hash"]
        ok &= rec["keylen"] <= MAX_KEY
        ok &= rec["keylen"] > 0
        return JournalEntries(live[ok], rec[ok], int((~ok).sum()), live[~ok])

    # -- namespaces and domains ---------------------------------------------------------------------------
    def set_namespace(self, ns_id: int, description: dict[str, object]) -> None:
        if not 0 <= ns_id < MAX_NAMESPACES:
            raise ValueError(f"namespace id {ns_id} outside the journal (0..{MAX_NAMESPACES - 1})")
        self._put_blob(self._ns_at + ns_id * _NS_BYTES, _NS_BYTES, json.dumps(description, sort_keys=True).encode())

    def namespaces(self, count: int = MAX_NAMESPACES) -> tuple[dict[int, dict[str, object]], int]:
        """(namespace id -> description, how many records failed their check) over the first `count` ids; ids
        never written are absent."""
        out: dict[int, dict[str, object]] = {}
        bad = 0
        for ns_id in range(min(count, MAX_NAMESPACES)):
            raw = self._get_blob(self._ns_at + ns_id * _NS_BYTES, _NS_BYTES)
            if raw is None:
                continue
            try:
                desc = json.loads(raw)
                if not isinstance(desc, dict) or not isinstance(desc.get("name"), str):
                    raise ValueError
            except ValueError:
                bad += 1
                continue
            out[ns_id] = desc
        return out, bad

    def namespace_ids_written(self) -> int:
        """One past the highest namespace id with a record (0 when none): how far `namespaces` must look."""
        step = np.frombuffer(self._mm, dtype="<u8", count=MAX_NAMESPACES * _NS_BYTES // 8, offset=self._ns_at)
        used = np.flatnonzero(step[:: _NS_BYTES // 8] != 0)
        return int(used[-1]) + 1 if len(used) else 0

    def set_domain(self, index: int, name: str) -> None:
        if not 0 <= index < MAX_DOMAINS:
            raise ValueError(f"domain index {index} outside the journal (0..{MAX_DOMAINS - 1})")
        self._put_blob(self._domains_at + index * _DOMAIN_BYTES, _DOMAIN_BYTES, name.encode())

    def domains(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for i in range(MAX_DOMAINS):
            raw = self._get_blob(self._domains_at + i * _DOMAIN_BYTES, _DOMAIN_BYTES)
            if raw is None:
                break  # indexes are handed out densely from 0
            try:
                out[i] = raw.decode()
            except UnicodeDecodeError:
                continue
        return out

    def set_slab_domain(self, slab: int, index: int) -> None:
        self._slab_domains[slab] = index + 1

    def slab_domains(self) -> np.ndarray:
        """Domain index per slab (-1: never written, i.e. the shared file)."""
        return self._slab_domains.astype(np.int64) - 1

    def _put_blob(self, at: int, room: int, payload: bytes) -> None:
        if _BLOB.size + len(payload) > room:
            raise ValueError(f"journal record of {len(payload)} bytes does not fit its {room}-byte place")
        self._mm[at: at + _BLOB.size] = bytes(_BLOB.size)  # absent while the payload is written
        self._mm[at + _BLOB.size: at + _BLOB.size + len(payload)] = payload
        self._mm[at: at + _BLOB.size] = _BLOB.pack(xxhash.xxh3_64_intdigest(payload) or 1, len(payload))

    def _get_blob(self, at: int, room: int) -> bytes | None:
        digest, length = _BLOB.unpack_from(self._mm, at)
        if not digest or length > room - _BLOB.size:
            return None
        payload = bytes(self._mm[at + _BLOB.size: at + _BLOB.size + length])
        return payload if (xxhash.xxh3_64_intdigest(payload) or 1) == digest else None

    def close(self) -> None:
        """Unmap and close (only once nothing holds a view: the daemon keeps it for its life)."""
        self.entries = None  # type: ignore[assignment]
        self._slab_domains = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _round(n: int) -> int:
    return -(-n // _PAGE) * _PAGE
