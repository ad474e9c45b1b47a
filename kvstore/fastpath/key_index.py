"""The shared key index: which keys the daemon holds in RAM, in a table same-node clients read with no syscall.

The table itself (layout, hash, sequence lock) is kvstore/_native/key_index.c. Here are its two owners:

- `IndexTable` (daemon): one per tenant (with tenancy off, one for everyone), in a sealed memfd like the arena
  files. The engine's `KeyIndexMirror` writes it under the engine's lock as blocks become visible in RAM
  (commit, promotion) and stop being (eviction, deletion). A client gets a read-only descriptor of its own
  tenant's table over the same-node socket, after the token check: another tenant's keys are not in it, and
  the client cannot write it (the descriptor is opened O_RDONLY, the file sealed against resizing).
- `IndexView` (client): the mapping, and `probe`, which answers how many leading keys are indexed, with
  their entry ids and serials (`entries`: also their blocks' sizes, arena offsets and checksums).

What a probe answer means: these keys were in RAM an instant ago. It is a hint, never trusted: the client
sends the ids in a PROBE request and the daemon checks each (same namespace, still committed, same serial)
under its lock, so the reply is exactly what a Lookup would have said then, with the same effects (policy
touches, counters, disk prefetch of the keys past the prefix). What the index saves is the daemon's per-key
work and the key bytes on the wire. A key missing from the table (never indexed, the table was 3/4 full, a
writer in the way) only makes the daemon look it up the usual way. A counting Lookup whose every key is in the
table is answered by the client alone (client/control.py: no round trip); the daemon still checks the ids it
is then sent one way, and counts and touches only the entries that hold.

What a key's absence means: usually nothing (it may be on disk, at a peer, or skipped by a full table). But a
daemon with RAM only whose table never skipped a key sets the header's `authority`, and then absence is an
answer too, once no Store has answered its client before indexing its keys: the daemon counts those binds
(`deferred` before the reply, `bound` once the keys are written), and a client that reads them equal before
its probe and `deferred` unchanged after it has seen every key a Lookup would have found (`MissState`). A
counting Lookup that stops short is then answered by the client as well, its effects (the hits, the miss
counted and explained) sent one way.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import kvstore._native._keyindex as _keyindex

__all__ = ["IndexTable", "IndexView", "Entries", "MissState", "HEADER", "capacity_for"]

HEADER = struct.Struct("<QQQQQ")  # magic, capacity, seq, count, incarnation; then the words (key_index.c)
AUTHORITY, DEFERRED, BOUND = 0, 1, 2  # the header words after HEADER (key_index.c), set by `set_word`
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Both sides map the whole table up front (the daemon allocates every page first). A key hashes to a random
# slot, so a table touched as used takes a page fault on most new keys until every page has been hit once:
# on a fresh daemon that was ~3 us a key in the writer (a Store of 32 new keys: 100 us of the engine's 700) and
# a fault in a reader's first probe of each page. 48 bytes a slot, 2 slots a key.
_POPULATED = mmap.MAP_SHARED | mmap.MAP_POPULATE


def capacity_for(entries: int) -> int:
    """Slots for `entries` keys at most half full (a linear-probing table stays fast below ~3/4)."""
    cap = 2
    while cap < 2 * max(1, entries):
        cap *= 2
    return cap


def table_bytes(capacity: int) -> int:
    return _keyindex.HEADER_BYTES + capacity * _keyindex.SLOT_BYTES


class IndexTable:
    """The daemon's writable table of one tenant. Not thread-safe: the engine calls it under its lock."""

    def __init__(self, label: str, capacity: int, incarnation: int) -> None:
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"key index capacity {capacity} is not a power of two >= 2")
        self.capacity = capacity
        self.size = table_bytes(capacity)
        self._fd = os.memfd_create(f"kvstore-keyindex-{label}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, self.size)
            os.posix_fallocate(self._fd, 0, self.size)  # every page now, like the arena: see _POPULATED
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
            self._mm = mmap.mmap(self._fd, self.size, _POPULATED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        HEADER.pack_into(self._mm, 0, _keyindex.MAGIC, capacity, 0, 0, incarnation)

    @classmethod
    def adopt(cls, fd: int, capacity: int, incarnation: int) -> IndexTable:
        """A predecessor daemon's table (a hand-over restart: its clients keep reading it), written on from
        here; `fd` is owned from now on. ValueError (fd closed) unless it is a key index of this capacity and
        incarnation."""
        self = cls.__new__(cls)
        try:
            self.capacity, self.size, self._fd = capacity, table_bytes(capacity), fd
            if os.fstat(fd).st_size != self.size:
                raise ValueError(f"a key index of {os.fstat(fd).st_size} bytes, expected {self.size}")
            self._mm = mmap.mmap(fd, self.size, _POPULATED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        magic, cap, _, _, inc = HEADER.unpack_from(self._mm, 0)
        if (magic, cap, inc) != (_keyindex.MAGIC, capacity, incarnation):
            self.close()
            raise ValueError("the key index handed over is not this daemon's (magic, capacity or incarnation)")
        return self

    @property
    def fd(self) -> int:
        return self._fd

    def words(self) -> tuple[int, int, int]:
        """(authority, deferred, bound) as the header holds them."""
        return tuple(int(w) for w in _keyindex.words(self._mm))  # type: ignore[return-value]

    def set_authority(self, authoritative: bool) -> None:
        """Whether a key's absence here is an answer (RAM is the daemon's only tier, no key was ever skipped)."""
        _keyindex.set_word(self._mm, self.capacity, AUTHORITY, int(authoritative))

    def set_binds(self, deferred: int, bound: int) -> None:
        """The daemon's count of Stores answered before their keys were indexed, and of those since indexed
        (`deferred` before the reply goes out, `bound` after the keys are written)."""
        self.set_bound(bound)
        self.set_deferred(deferred)

    def set_deferred(self, deferred: int) -> None:
        _keyindex.set_word(self._mm, self.capacity, DEFERRED, deferred)

    def set_bound(self, bound: int) -> None:
        _keyindex.set_word(self._mm, self.capacity, BOUND, bound)

    def insert(self, namespace: str, keys: list[bytes], eids: list[int], serials: list[int],
               sizes: list[int] | None = None, offsets: list[int] | None = None,
               checksums: list[int] | None = None) -> int:
        """Index `keys` (the entries' ids and serials; their block sizes, arena offsets and checksums, which a
        client's counting Lookup answers with; zeros when not given)."""
        zeros = [0] * len(keys)
        return int(_keyindex.insert(self._mm, self.capacity, namespace, keys, eids, serials,
                                    zeros if sizes is None else sizes, zeros if offsets is None else offsets,
                                    zeros if checksums is None else checksums))

    def remove(self, namespace: str, keys: list[bytes]) -> int:
        return int(_keyindex.remove(self._mm, self.capacity, namespace, keys))

    @property
    def count(self) -> int:
        return int(HEADER.unpack_from(self._mm, 0)[3])

    def reader_fd(self) -> int:
        """A new read-only descriptor of the table, for a client (the caller sends it, then closes it)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        self._mm.close()
        os.close(self._fd)


@dataclass(frozen=True)
class MissState:
    """The header words a reader takes before its probe (IndexView.miss_state)."""

    authority: int
    deferred: int
    bound: int

    @property
    def settled(self) -> bool:
        """A key's absence is an answer now: authoritative, and every bind answered early is done."""
        return bool(self.authority) and self.deferred == self.bound

    def still(self, after: MissState) -> bool:
        """Nothing that could add a key unseen happened between this read and `after` (read after the probe):
        no Store deferred its binding, the table stayed authoritative."""
        return after.deferred == self.deferred and after.authority == self.authority


@dataclass(frozen=True)
class Entries:
    """What the table says of a batch's leading `n` keys (IndexView.entries): ids and serials as the daemon
    checks them (u32 little-endian bytes), the blocks' sizes, arena offsets and checksums, and `seq`."""

    n: int
    ids: bytes
    serials: bytes
    sizes: np.ndarray
    offsets: np.ndarray
    checksums: np.ndarray
    seq: int


class IndexView:
    """A client's read-only mapping of its tenant's table. The mapping lives as long as this object and any
    probe running on it (the C probe holds the buffer), so dropping a view under a probing thread is safe."""

    def __init__(self, fd: int) -> None:
        """Maps `fd` read-only and closes it. ValueError when it is not a key index."""
        try:
            size = os.fstat(fd).st_size
            if size < _keyindex.HEADER_BYTES:
                raise ValueError(f"the key index file has {size} bytes, less than its header")
            self._mm = mmap.mmap(fd, size, _POPULATED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, capacity, _, _, self.incarnation = HEADER.unpack_from(self._mm, 0)
        if magic != _keyindex.MAGIC or size < table_bytes(capacity):
            self._mm.close()
            raise ValueError("the file handed over is not a kvstore key index of the size it announces")
        self.capacity = int(capacity)

    def probe(self, namespace: str, keys: Sequence[bytes]) -> tuple[int, bytes, bytes] | None:
        """(leading keys indexed, their entry ids, their serials: u32 little-endian each) or None when the
        daemon kept writing the table during the probe (ask the daemon)."""
        return _keyindex.probe(self._mm, namespace, keys if isinstance(keys, list) else list(keys))

    def entries(self, namespace: str, keys: list[bytes]) -> Entries | None:
        """`probe` with every column of the leading keys' entries, and the sequence number they were read under
        (`unchanged(seq)` afterwards: no entry of the table changed since). None: ask the daemon."""
        got = _keyindex.entries(self._mm, namespace, keys)
        if got is None:
            return None
        n, ids, serials, sizes, offsets, checksums, seq = got
        return Entries(n, ids, serials, np.frombuffer(sizes, "<u8"), np.frombuffer(offsets, "<u8"),
                       np.frombuffer(checksums, "<u8"), seq)

    def miss_state(self) -> MissState:
        """`deferred`, then `bound`, then `authority`, as the writer's order needs (key_index.c)."""
        return MissState(*_keyindex.words(self._mm))

    def unchanged(self, seq: int) -> bool:
        """Whether the daemon has written nothing to the table since a read made under `seq`."""
        return int(_keyindex.seq(self._mm)) == seq

    @property
    def count(self) -> int:
        return int(HEADER.unpack_from(self._mm, 0)[3])
