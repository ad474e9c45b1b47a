"""The daemon's RAM tier under a policy other than LRU (S3-FIFO), exact: the REAL policy class, driven with the
engine's event order.

Why drive kvstore.policies' own class rather than re-derive S3-FIFO here: the replay checks the store against
this model request by request, so what matters is the daemon's exact decisions (its 2-bit CLOCK over M, the
ghost bound taken at each eviction, re-insertion of ineligible entries at their queue's head), and the only
way a second implementation stays equal to it is to be it. What this module copies is the ENGINE's side,
the order in which the policy hears of things (kvstore/engine: ram_space.py, lookups.py, disk_link.py,
read_buffer.py):

- hits are deferred (ReadBuffer) and replayed, in order, through `on_access_batches` before anything else
  reaches the policy: an insert, a victim choice. A probe's RAM hits are recorded before its promotions
  allocate; the get's hits (the whole prefix, in RAM by then) before the put's evictions.
- an allocation takes a free slot when there is one, else asks `choose_victim(eligible)` until one is freed
  (one slot per slab of exactly one block: one victim, one slot). `eligible` is "not in keep": the entries
  this call found present (a probe's RAM hits; a put's blocks already in RAM) must survive it; entries being
  written or leased are never seen by the replay's sync points (replayer.py).
- a put (Reserve + Commit) allocates every new block first, all or nothing (victims already taken stay
  evicted), then inserts them in chain order with `on_insert(eid, fingerprint)`.
- a probe's promotions allocate a slot each, in chain order, BEFORE any of them is inserted (the slots are
  PROMOTING, untracked by the policy); each is inserted when its read lands. The daemon's two promoter
  threads land them in either order: `landing` (default: chain order) gives the order they were inserted in,
  which the replay observes (landing.py) and hands to the model; with one promotion there is no choice.
- fingerprints: the engine passes hash(key) ^ namespace id; S3-FIFO only ever compares fingerprints for
  equality (its ghost), so any per-key injective value gives the same decisions: the key's first 8 bytes
  (a sha256 prefix). Entry ids: the catalog reuses freed ids; the policy resets every per-id field on insert
  and keys the ghost by fingerprint, so ids are free-list reused here too, and their values change nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from kvstore.policies import make_policy
from kvstore.policies.hinted import RELEASED, RETAINED, HintedPolicy, with_hints

__all__ = ["PolicyTier", "HintedPolicyTier", "HintPins", "fingerprint", "CLOCK_TICK_S"]

# HintedPolicyTier's clock: every reading moves it on by this much, so a Retain ended with the replay's
# 1e-9 s ttl (hints.EXPIRE_TTL_S) has expired by the next victim choice, as on the daemon's monotonic clock,
# and one sent with the daemon's max ttl (600 s) never expires within a run (6e8 readings)
CLOCK_TICK_S = 1e-6


def fingerprint(key: bytes) -> int:
    """A nonzero 64-bit identity of a block key (0 would mean "never remembered" to the policy)."""
    return int.from_bytes(key[:8], "little") or 1


class PolicyTier:
    """The RAM tier as the daemon runs it under `policy` (a kvstore policy name); capacity in blocks."""

    def __init__(self, name: str, capacity_blocks: int, policy: str = "s3fifo") -> None:
        if capacity_blocks < 1:
            raise ValueError(f"tier {name}: capacity_blocks={capacity_blocks} must be >= 1")
        self.name = name
        self.capacity_blocks: int | None = capacity_blocks
        self.policy_name = policy
        self.policy = with_hints(make_policy(policy))  # the engine wraps whatever policy it is given
        self._eid: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        self._free: list[int] = []
        self._pending: list[np.ndarray] = []  # the read buffer: hits not yet told to the policy

    def __contains__(self, key: object) -> bool:
        return key in self._eid

    def __len__(self) -> int:
        return len(self._eid)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Hits, in order (deferred, like the engine's read buffer)."""
        if keys:
            eid = self._eid
            self._pending.append(np.fromiter((eid[k] for k in keys), dtype=np.int64, count=len(keys)))

    def _apply(self) -> None:
        if self._pending:
            self.policy.on_access_batches(self._pending)
            self._pending = []

    def _evict(self, keep: set[int]) -> bytes | None:
        """One victim chosen by the policy outside `keep` (entry ids), forgotten; None: nothing evictable."""
        self._apply()
        eid = self.policy.choose_victim((lambda e: e not in keep) if keep else (lambda e: True))
        if eid is None:
            return None
        key = self._key.pop(eid)
        del self._eid[key]
        self._free.append(eid)
        return key

    def _insert(self, keys: Sequence[bytes]) -> None:
        self._apply()
        for k in keys:
            eid = self._free.pop() if self._free else len(self._eid)  # no free id: 0..n-1 are all in use
            self._eid[k], self._key[eid] = eid, k
            self.policy.on_insert(eid, fingerprint(k))

    def _held(self, keep: Collection[bytes]) -> set[int]:
        """The entry ids no victim may be: those the call found present."""
        return {self._eid[k] for k in keep if k in self._eid}

    def free_slots(self) -> int:
        """Slots no entry holds."""
        return (1 << 62) if self.capacity_blocks is None else self.capacity_blocks - len(self._eid)

    def take_victim(self, keep: Collection[bytes]) -> bytes | None:
        """One victim chosen by the policy outside `keep` (the keys the call holds), forgotten; None: none."""
        return self._evict(self._held(keep))

    def insert_landed(self, keys: Sequence[bytes]) -> None:
        """Blocks that got a slot (a put's, promotions in the order they landed), inserted in that order."""
        self._insert(keys)

    def admit(self, keys: Sequence[bytes], keep: Collection[bytes]) -> tuple[bool, list[bytes]]:
        """Reserve + Commit of absent keys: all slots first (all or nothing), then the inserts in order."""
        from bench.replay.sim import admit

        return admit(self, keys, keep)


class HintPins:
    """Hint pins as both hinted RAM models keep them (hints.HintedLRU, HintedPolicyTier): the pinned keys, and
    the daemon's budget without tenant quotas, half the arena, counted in blocks of the store."""

    pinned: set[bytes]
    capacity_blocks: int | None

    @property
    def pin_budget(self) -> int:
        return (self.capacity_blocks or 0) // 2

    def pin(self, key: bytes) -> bool:
        """False: over the pin budget (nothing pinned); a key pinned again counts once."""
        if key not in self.pinned:
            if len(self.pinned) + 1 > self.pin_budget:
                return False
            self.pinned.add(key)
        return True


class HintedPolicyTier(HintPins, PolicyTier):
    """The RAM tier under `policy` with the engine's hints (kvstore/engine/hints.py), for hints.apply_hint.

    Retain and Release go to the REAL HintedPolicy the tier already drives (its priority classes, release order
    and pressure rule are then the daemon's by construction), on a clock of its own (CLOCK_TICK_S). Pins are the
    catalog's in the daemon, outside the policy: here a set of keys no victim may be, like the keys a call holds.
    """

    def __init__(self, name: str, capacity_blocks: int, policy: str = "s3fifo") -> None:
        super().__init__(name, capacity_blocks, policy)
        self._now = 0.0
        self.policy = HintedPolicy(make_policy(policy), clock=self._tick)
        self.pinned: set[bytes] = set()

    def _tick(self) -> float:
        self._now += CLOCK_TICK_S
        return self._now

    def _held(self, keep: Collection[bytes]) -> set[int]:
        eid = self._eid
        return {eid[k] for k in keep if k in eid} | {eid[k] for k in self.pinned if k in eid}

    def retain(self, key: bytes, ttl_s: float, expire: bool) -> None:
        """A Retain of an entry in RAM (`expire`: the replay ending an earlier one with a tiny ttl)."""
        self._apply()  # the engine applies pending hits before a hint (Hints.apply)
        self.policy.set_priority(self._eid[key], RETAINED, self._tick() + ttl_s)

    def release(self, key: bytes) -> None:
        self._apply()
        self.policy.set_priority(self._eid[key], RELEASED)

