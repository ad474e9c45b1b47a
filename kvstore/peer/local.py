"""The local arena as the peer tier sees it: blocks opened for sending, slots reserved for receiving.

Both directions go through the engine's public two-phase primitives, so a block that arrives from a peer is
an ordinary committed block afterwards (a local hit), and a block being sent is an ordinary leased block
(never evicted or reused while its bytes are on the wire):

- `open_for_send(ns, keys)`: a local-only leasing lookup; per key its size (0: not here) and xxh3, plus one
  writable memoryview per found block. `close()` releases the lease. A block committed without a checksum
  (a local client's put) is hashed here once and the digest remembered in the catalog (Engine.note_checksums):
  a committed block's bytes never change, and the frame carries every checksum before the first block byte,
  so a digest computed at each send would sit in front of every fetch (one xxh3 pass of the batch, 2.4 ms of
  a 29 ms fetch of 64 MiB measured here).
- `receive(ns, keys, sizes)`: one Reserve for the batch; a memoryview of each reserved slot (None for a key
  already present or in flight: its bytes are read and dropped). `landed(j)` hashes block j as soon as its
  last byte is in (cache-hot, while the sender keeps filling the socket: free here, where hashing the whole
  batch after its last byte cost 7-10 % of the fetch); `finish(checksums)` verifies xxh3 of every slot
  (those `landed` hashed, the rest now) and commits, or aborts the whole reservation if any block is damaged
  (a miss, counted). A slot is hashed after its last byte is written and nothing writes it again before the
  commit: the digest checked is the digest of the bytes committed.

Both carry `live_until`, the monotonic time until which their slots may be touched: the reservation's (or
lease's) expiry, measured from just before the engine call (so never later than the engine's own clock says),
less a safety margin (`safe_margin_s`). A receiver must write no byte into a reserved slot after it: once a
reservation expires its slots go to quarantine and then to a new owner, and bytes still trickling in for the
old one would land in someone else's block. The data planes bound every receive into a slot by it, and abort
the reservation themselves when it fires (abort frees the slots at once: safe, because the aborting thread is
the one that was writing and has stopped).

Reservations made here are remembered (`is_own`) so the engine's commit hook does not push a block that came
from a peer back out again.

`admit_handoff(ns, keys, payload_bytes)`: which blocks of a hand-off this node takes; the peer tier installs
its intake (intake.py: ownership and a byte budget) with `set_handoff_gate`; without one, all of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvstore.errors import KVStoreError, UnknownNamespaceError
from kvstore.peer.counters import PeerCounters
from kvstore.peer.frames import NamespaceDesc
from kvstore.vocab import ReserveOutcome

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

__all__ = ["LocalStore", "Outgoing", "Incoming", "safe_margin_s"]

_NEVER = float("inf")


def safe_margin_s(ttl_s: float) -> float:
    """How long before a reservation's or lease's expiry its slots stop being touched: 10 % of the TTL, at least
    0.5 s (thread scheduling between a socket's poll and its copy into the slot, a GIL wait, a slow sweep)."""
    return max(0.5, 0.1 * ttl_s)


def _live_until(start: float, expires_in_ms: int) -> float:
    ttl = expires_in_ms / 1000.0
    return start + ttl - safe_margin_s(ttl)


@dataclass
class Outgoing:
    sizes: np.ndarray           # per requested key; 0 = not here
    checksums: np.ndarray       # per requested key
    views: list[memoryview]     # one per found block, in key order
    _close: Callable[[], object] | None = None
    live_until: float = _NEVER  # the lease's safe end: send no slot bytes after it

    @property
    def payload_bytes(self) -> int:
        return int(self.sizes.sum())

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


@dataclass
class Incoming:
    views: list[memoryview | None]   # one per block; None = read and drop
    reservation_id: int
    _store: LocalStore | None = field(default=None, repr=False)
    live_until: float = _NEVER  # the reservation's safe end: write no byte into its slots after it
    digests: dict[int, int] = field(default_factory=dict, repr=False)  # block -> xxh3, hashed as it landed

    def landed(self, block: int) -> None:
        """Block `block` is in whole: hash it now, while its bytes are in the cache (finish checks it)."""
        view = self.views[block]
        if view is not None:
            self.digests[block] = xxhash.xxh3_64_intdigest(view)

    def finish(self, checksums: np.ndarray) -> int:
        """Verify and commit; returns the blocks stored (0 if any reserved block failed its checksum)."""
        assert self._store is not None
        return self._store._finish(self, checksums)

    def abort(self) -> None:
        if self.reservation_id and self._store is not None:
            self._store._abort(self.reservation_id)
            self.reservation_id = 0


def _hashed(view: memoryview, offset: int, into: tuple[list[int], list[int]]) -> int:
    digest = xxhash.xxh3_64_intdigest(view)
    into[0].append(offset)
    into[1].append(digest)
    return digest


class LocalStore:
    def __init__(self, engine: Engine, view: np.ndarray, counters: PeerCounters) -> None:
        self._engine = engine
        self._view = view
        self._counters = counters
        self._own: set[int] = set()
        self._own_lock = threading.Lock()
        self._descs: dict[str, NamespaceDesc] = {}
        self._handoff_gate: Callable[[str, list[bytes], int], list[bool]] | None = None

    # -- sending ----------------------------------------------------------------------------------------
    def open_for_send(self, namespace: str, keys: list[bytes]) -> Outgoing:
        n = len(keys)
        start = time.monotonic()
        try:
            r = self._engine.lookup(namespace, keys, prefix=False, lease=True, local_only=True)
        except UnknownNamespaceError:
            return Outgoing(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint64), [])
        sizes = np.zeros(n, dtype=np.int64)
        sums = np.zeros(n, dtype=np.uint64)
        views: list[memoryview] = []
        hashed: tuple[list[int], list[int]] = ([], [])  # (offset, digest) of blocks committed without one
        hit = 0
        for i, present in enumerate(r.present):
            if not present:
                continue
            off, size = r.offsets[hit], r.sizes[hit]
            mv = memoryview(self._view[off: off + size])  # type: ignore[arg-type]  # numpy's stubs do not declare ndarray a Buffer
            sizes[i] = size
            sums[i] = r.checksums[hit] or _hashed(mv, off, hashed)
            views.append(mv)
            hit += 1
        lease = r.lease_id
        if hashed[0] and lease:
            self._engine.note_checksums(lease, *hashed)  # the lease holds the slots: still these bytes
        return Outgoing(sizes, sums, views, (lambda: self._engine.release([lease])) if lease else None,
                        _live_until(start, r.expires_in_ms) if lease else _NEVER)

    def present(self, namespace: str, keys: list[bytes]) -> list[bool]:
        """Which keys this node holds (RAM, promoting or disk): a probe's answer; no lease, no promotion."""
        try:
            return self._engine.exists(namespace, keys)
        except KVStoreError:   # unknown namespace, keys the engine refuses: nothing here
            return [False] * len(keys)

    def tiers(self, namespace: str, keys: list[bytes]) -> list[int]:
        """Each key's tier here (Tier: NONE, RAM, DISK): a tiers probe's answer (a router's prefix score)."""
        try:
            return self._engine.tiers(namespace, keys)
        except KVStoreError:   # unknown namespace, keys the engine refuses: nothing here
            return [0] * len(keys)

    def claim(self, namespace: str, keys: list[bytes], claimant: bytes, ttl_ms: int) -> list[int]:
        """A claiming probe's answer (kvstore/engine/claims.py): per key HELD here, PENDING (another
        claimant's live claim here) or CLAIMED (recorded here for the caller); this node's tiers only."""
        try:
            return self._engine.claim(namespace, keys, claimant, ttl_ms, local_only=True)
        except KVStoreError:   # keys the engine refuses: nothing recorded, the caller computes them
            return [0] * len(keys)

    def namespaces(self) -> list[str]:
        """The namespaces registered here (a hand-off walks each)."""
        return [ns.name for ns in self._engine.stats().namespaces]

    def held(self, namespace: str) -> list[bytes]:
        """Every key held here in the namespace (RAM or disk), unordered; [] for an unknown namespace."""
        try:
            return self._engine.held_keys(namespace)
        except KVStoreError:
            return []

    def sizes(self, namespace: str, keys: list[bytes]) -> dict[bytes, int]:
        """Sizes of the keys held here (absent keys are left out)."""
        try:
            return {r.key: r.size for r in self._engine.describe(namespace, keys)}
        except KVStoreError:
            return {}

    def let_go(self, namespace: str, keys: list[bytes], drop: bool = False) -> int:
        """These RAM copies first to go, or dropped now (guests.py); how many."""
        return self._engine.let_go(namespace, keys, drop)

    def set_handoff_gate(self, gate: Callable[[str, list[bytes], int], list[bool]] | None) -> None:
        self._handoff_gate = gate

    def admit_handoff(self, namespace: str, keys: list[bytes], payload_bytes: int) -> list[bool]:
        """Per block of a hand-off: take it (True) or read it into scratch and drop it."""
        gate = self._handoff_gate
        return [True] * len(keys) if gate is None else gate(namespace, keys, payload_bytes)

    def describe(self, namespace: str) -> NamespaceDesc:
        """The namespace's description, for pushes (cached: descriptions never change once registered)."""
        d = self._descs.get(namespace)
        if d is None:
            for ns in self._engine.stats().namespaces:
                self._descs[ns.name] = NamespaceDesc(ns.name, ns.model, ns.layout_digest, ns.tenant,
                                                     ns.tokens_per_block)
            d = self._descs.get(namespace, NamespaceDesc(namespace))
        return d

    # -- receiving --------------------------------------------------------------------------------------
    def receive(self, namespace: str, keys: list[bytes], sizes: list[int],
                desc: NamespaceDesc | None = None) -> Incoming | None:
        """Slots for a batch of blocks; None when they cannot be stored here (full, invalid): drop the bytes."""
        if desc is not None:
            try:
                self._engine.register_namespace(desc.name, desc.model, desc.layout_digest, desc.tenant,
                                                tokens_per_block=desc.tokens_per_block or None)
            except KVStoreError:
                return None  # a conflicting description here: never mix layouts
        start = time.monotonic()  # before the engine starts the reservation's clock
        try:
            r = self._engine.reserve(namespace, keys, sizes)
        except KVStoreError:
            return None
        views: list[memoryview | None] = [
            memoryview(self._view[off: off + size])  # type: ignore[arg-type]  # numpy's stubs do not declare ndarray a Buffer
            if outcome == ReserveOutcome.RESERVED else None
            for off, size, outcome in zip(r.offsets, sizes, r.outcomes)]
        if r.reservation_id:
            with self._own_lock:
                self._own.add(r.reservation_id)
        return Incoming(views, r.reservation_id, self,
                        _live_until(start, r.expires_in_ms) if r.reservation_id else _NEVER)

    def _finish(self, inc: Incoming, checksums: np.ndarray) -> int:
        if not inc.reservation_id:
            return 0
        kept = []
        for j, (view, expected) in enumerate(zip(inc.views, checksums.tolist())):
            if view is None:
                continue
            digest = inc.digests.get(j)
            if digest is None:
                digest = xxhash.xxh3_64_intdigest(view)
            if expected and digest != expected:  # 0: the sender had none (only the grpc plane's Get stream)
                self._counters.add("checksum_failures")
                self._engine.note_checksum_failure()
                inc.abort()
                return 0
            kept.append(digest)
        try:
            n = self._engine.commit(inc.reservation_id, kept)
        except KVStoreError:  # expired while the bytes were on the wire: a miss
            n = 0
        with self._own_lock:
            self._own.discard(inc.reservation_id)
        inc.reservation_id = 0
        return n

    def _abort(self, rid: int) -> None:
        try:
            self._engine.abort(rid)
        except KVStoreError:
            pass
        with self._own_lock:
            self._own.discard(rid)

    def is_own(self, reservation_id: int) -> bool:
        """True for a reservation this module made (a block from a peer): the commit hook must not push it."""
        with self._own_lock:
            return reservation_id in self._own
