"""Offline exact simulation of the store's block cache: pure Python, no daemon, same access order.

Why exact and not "an LRU of about this size": the replay through the real daemon is checked against this
model request by request, so the model copies the daemon's event order, including its corner cases:

- lookup: the leading present blocks are touched in order (the daemon defers these touches but applies them,
  in order, before any insert or eviction, so the order is the same). The replayer's lookup_prefix and the
  get that follows touch the same run twice in a row, which leaves the LRU order as one pass does.
- put: only blocks not present anywhere are inserted, in order, as most recent; blocks already present are
  not touched (Reserve answers ALREADY_PRESENT and leaves them alone) and cannot be evicted to make room for
  this put (the engine's `keep` set). Victims are the least recent other entries. Like Reserve, it is all or
  nothing: when too few entries are evictable, the victims already taken stay evicted and nothing is stored.
- Because touches go first-block-first, the head of a chain is older than its tail and goes first: a chain
  can lose its head and keep an orphaned tail, which a later put then finds ALREADY_PRESENT.

Tiers are pluggable (`SimTier`): tier 0 is RAM; each tier's victims are offered to the next (demotion), and a
hit below tier 0 moves the block up to tier 0 (exclusive caching). Only the one-tier path is checked against
the daemon today; the disk and peer issues will pin down the lower tiers' rules and check them the same way.
An unbounded tier (capacity None) gives the infinite-cache maximum.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.replay.keys import chain_keys
from bench.replay.trace import Convention, Request

__all__ = ["SimTier", "LRUTier", "CacheSim", "SimResult", "simulate", "infinite_cache"]


class SimTier(Protocol):
    """One level of the simulated hierarchy. Keys are the 32-byte chained block keys."""

    name: str
    capacity_blocks: int | None

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def touch(self, keys: Sequence[bytes]) -> None:
        """Hits, in order."""

    def admit(self, keys: Sequence[bytes], keep: Collection[bytes]) -> tuple[bool, list[bytes]]:
        """Insert absent keys as most recent, in order, evicting outside `keep`: (stored?, victims in order)."""

    def remove(self, key: bytes) -> None: ...


class LRUTier:
    """Exact LRU over block keys; an OrderedDict from least to most recent."""

    def __init__(self, name: str, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"tier {name}: capacity_blocks={capacity_blocks} must be >= 1 (or None: unbounded)")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self._od: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def __len__(self) -> int:
        return len(self._od)

    def touch(self, keys: Sequence[bytes]) -> None:
        move = self._od.move_to_end
        for k in keys:
            move(k)

    def admit(self, keys: Sequence[bytes], keep: Collection[bytes]) -> tuple[bool, list[bytes]]:
        od = self._od
        need = 0 if self.capacity_blocks is None else len(od) + len(keys) - self.capacity_blocks
        victims: list[bytes] = []
        if need > 0:
            for k in od:  # least recent first
                if k not in keep:
                    victims.append(k)
                    if len(victims) == need:
                        break
            for k in victims:
                del od[k]
            if len(victims) < need:
                return False, victims
        for k in keys:
            od[k] = None
        return True, victims

    def remove(self, key: bytes) -> None:
        self._od.pop(key, None)


class CacheSim:
    """A hierarchy of tiers driven with the connector's calls: lookup(prefix) then put(missed blocks)."""

    def __init__(self, tiers: Sequence[SimTier]) -> None:
        if not tiers:
            raise ValueError("CacheSim needs at least one tier")
        self.tiers = list(tiers)
        self.store_full = 0
        self.evictions = [0] * len(self.tiers)
        self.present_on_put = 0  # blocks a put found already stored: orphaned tails of evicted chain heads

    def _where(self, key: bytes) -> int:
        for i, t in enumerate(self.tiers):
            if key in t:
                return i
        return -1

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Tier index of each leading present block (its length is the prefix hit); hits are touched."""
        found: list[int] = []
        for k in keys:
            i = self._where(k)
            if i < 0:
                break
            found.append(i)
        ram = self.tiers[0]
        prefix = set(keys[: len(found)])  # held like leases: a promotion must not evict the run it serves
        run: list[bytes] = []
        for k, i in zip(keys, found):
            if i == 0:
                run.append(k)
                continue
            ram.touch(run)
            run = []
            self.tiers[i].remove(k)
            self._admit(0, [k], prefix)
        ram.touch(run)
        return found

    def put(self, keys: Sequence[bytes]) -> int:
        """Insert the absent blocks of `keys` into tier 0; how many were stored."""
        present = {k for k in keys if self._where(k) >= 0}
        new = [k for k in keys if k not in present]
        if new and not self._admit(0, new, present):
            return 0  # like a failed Reserve, which reports nothing about the keys it found
        self.present_on_put += len(present)
        return len(new)

    def _admit(self, level: int, keys: Sequence[bytes], keep: Collection[bytes]) -> bool:
        stored, victims = self.tiers[level].admit(keys, keep)
        self.evictions[level] += len(victims)
        if not stored:
            self.store_full += 1
        if level + 1 < len(self.tiers):
            for v in victims:  # one at a time: a victim batch larger than the next tier still fills it
                self._admit(level + 1, [v], ())
        return stored


@dataclass
class SimResult:
    """Per-request prefix hits in blocks, and where they were found."""

    hits: list[int]
    hits_by_tier: list[int]
    stored_blocks: int = 0
    store_full: int = 0
    tier_names: list[str] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)  # per tier
    resident: list[int] = field(default_factory=list)  # blocks per tier at the end
    present_on_put: int = 0


def simulate(requests: Sequence[Request], tiers: Sequence[SimTier],
             convention: Convention = Convention.FULL_BLOCKS) -> SimResult:
    sim = CacheSim(tiers)
    hits: list[int] = []
    by_tier = [0] * len(tiers)
    stored = 0
    for r in requests:
        keys = chain_keys(r.cacheable_ids(convention))
        found = sim.lookup(keys)
        for i in found:
            by_tier[i] += 1
        hits.append(len(found))
        if len(found) < len(keys):
            stored += sim.put(keys[len(found):])
    return SimResult(hits, by_tier, stored, sim.store_full, [t.name for t in tiers], sim.evictions,
                     [len(t) for t in sim.tiers], sim.present_on_put)


def infinite_cache(requests: Sequence[Request], convention: Convention = Convention.FULL_BLOCKS) -> SimResult:
    """The maximum: a block hits whenever its whole prefix was seen before (nothing is ever evicted)."""
    return simulate(requests, [LRUTier("infinite", None)], convention)
