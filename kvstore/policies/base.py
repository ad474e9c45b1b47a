"""Eviction-policy interface of the RAM catalog.

A policy only *decides* which cached block goes next.  It does no I/O and
holds no lock of its own: the engine calls every method under the engine's
lock, so implementations are deliberately single-threaded.

Entries are named by small dense integer ids (``eid`` in ``0..N``) that the
catalog assigns and reuses after removal.  Per-entry state therefore lives in
numpy arrays indexed by id (grown by doubling), never in per-entry Python
objects: the catalog budgets <= 256 bytes of daemon RSS per cached block at
1M blocks, and a dict/OrderedDict entry alone costs ~100 bytes.

Primitives and their contracts:

``name: str``
    Class attribute; the name ``make_policy`` knows the policy by.

``on_insert(eid, fingerprint=0) -> None``
    ``eid`` became resident and committed and is now tracked.  ``fingerprint``
    is a stable 64-bit identity of the *content* (e.g. the block hash), taken
    modulo 2**64.  Ids are reused, so policies that remember evicted entries
    (S3-FIFO's ghost) key that memory by fingerprint, never by id.  ``0``
    means "no fingerprint": such entries are never remembered.  Policies
    without history (LRU) ignore it.  Raises ``ValueError`` if ``eid`` is
    negative or already tracked (a catalog bug).  Amortised O(1).

``on_access(eid) -> None`` (and ``on_access_many(eids)``, the same in order)
    A hit on ``eid``.  Ignored if ``eid`` is not tracked (e.g. a hit on an
    entry whose write has not committed yet).  O(1).

``on_access_batches(batches) -> None``
    The hits of several arrays of ids, in order: the same as ``on_access_many``
    of each in turn (the engine's deferred read buffer replays through this).
    One call lets a policy skip work the later batches make moot.

``on_remove(eid) -> None``
    ``eid`` was deleted, or evicted by someone other than the policy; forget
    it.  Ignored if not tracked (idempotent, so a delete racing an eviction
    inside the engine is harmless).  Removal is not an eviction decision and
    is never recorded in eviction history.  O(1).

``choose_victim(eligible) -> int | None``
    Return the entry to evict next and forget it (as if ``on_remove``).
    Entries for which ``eligible(eid)`` is False (leased, pinned, being
    written...) are skipped but stay tracked: LRU keeps them in place,
    S3-FIFO treats them as a re-insertion where its algorithm re-inserts.
    ``eligible`` must be a pure function for the duration of the call.
    Returns None when no tracked entry is eligible.  Always terminates after
    a bounded number of passes over the tracked entries (each policy
    documents its bound); O(1) amortised when the tail is eligible.

``__len__() -> int``
    Number of tracked entries.

``__contains__(eid) -> bool``
    Whether ``eid`` is tracked.

``memory_bytes() -> int``
    Bytes held by the per-id arrays (``nbytes``), so the catalog can check
    its RSS budget; bounded side structures are documented by each policy.

Priorities and expiries (the engine's Retain and Release hints) are not a
primitive each policy implements: ``HintedPolicy`` (hinted.py) wraps any
policy honouring this contract and adds ``set_priority(eid, priority,
until)``: RELEASED entries are victims before any other, RETAINED ones (until
a monotonic deadline) are skipped while another entry is eligible.  It needs
nothing more of the wrapped policy than the primitives above, so a new policy
gets hints for free; the engine wraps whatever policy it is given.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

import numpy as np

#: Capacity a fresh policy starts with; arrays grow by doubling from here.
DEFAULT_INITIAL_CAPACITY = 1024


class EvictionPolicy(abc.ABC):
    """Abstract eviction policy; see the module docstring for the contracts."""

    name: str = ""

    @abc.abstractmethod
    def on_insert(self, eid: int, fingerprint: int = 0) -> None:
        """Start tracking a newly committed entry."""

    def on_insert_many(self, eids: Sequence[int], fingerprints: Sequence[int] | None = None) -> None:
        """``on_insert`` of each id in order (``fingerprints``: one each, None when the policy wants none, see
        ``wants_fingerprints``); a policy may do it in one step (a Store commits its blocks together)."""
        on_insert = self.on_insert
        if fingerprints is None:
            for eid in eids:
                on_insert(eid)
        else:
            for eid, fp in zip(eids, fingerprints):
                on_insert(eid, fp)

    #: Whether ``on_insert`` uses its fingerprint: the engine hashes each key only for a policy that does.
    wants_fingerprints: bool = True

    @abc.abstractmethod
    def on_access(self, eid: int) -> None:
        """Record a hit."""

    def on_access_many(self, eids: Sequence[int] | np.ndarray) -> None:
        """Record hits in order (the engine replays its deferred read buffer through this)."""
        on_access = self.on_access
        for eid in (eids.tolist() if isinstance(eids, np.ndarray) else eids):
            on_access(eid)

    def on_access_batches(self, batches: Sequence[np.ndarray]) -> None:
        """Record several batches of hits in order; by ``on_access_many``'s contract, one concatenated call."""
        if batches:
            self.on_access_many(batches[0] if len(batches) == 1 else np.concatenate(batches))

    @abc.abstractmethod
    def on_remove(self, eid: int) -> None:
        """Forget an entry removed by someone else (O(1), idempotent)."""

    @abc.abstractmethod
    def choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        """Pick, forget and return the next victim, or None if none is eligible."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of tracked entries."""

    @abc.abstractmethod
    def __contains__(self, eid: object) -> bool:
        """Whether ``eid`` is tracked."""

    @abc.abstractmethod
    def memory_bytes(self) -> int:
        """Bytes held by the per-id arrays."""

    def order(self) -> list[int]:
        """Every tracked id, the next victim first: a successor daemon inserts them in this order (a hand-over
        restart, kvstore/engine/adoption.py), so its first victims are this one's. A policy that cannot say
        returns [] (the successor then inserts by entry id). O(tracked)."""
        return []


def grown_capacity(capacity: int, eid: int) -> int:
    """Smallest ``capacity * 2**k`` that can index ``eid``.

    Doubling keeps growth amortised O(1) per insert; the catalog can avoid
    the up-to-2x slack by passing its block count as ``initial_capacity``.
    """
    new = max(capacity, 1)
    while new <= eid:
        new *= 2
    return new


def grow_array(arr: np.ndarray, capacity: int, fill: int) -> np.ndarray:
    """Copy ``arr`` into a new array of ``capacity`` slots, padding with ``fill``."""
    out = np.full(capacity, fill, dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


def check_new_eid(eid: int) -> None:
    """Reject ids that cannot index the per-id arrays."""
    if eid < 0:
        raise ValueError(f"entry id must be >= 0, got {eid}")
