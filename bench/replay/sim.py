"""Offline exact simulation of the store: pure Python, no daemon, the same event order as the daemon.

Why exact and not "an LRU of about this size": the replay through the real daemon is checked against this
model request by request (and counter by counter), so the model copies the daemon's rules, corner cases
included. One concern a module:

- sim.py          the RAM tier under LRU (`LRUTier`), `simulate` (a trace through a CacheSim) and the
                  infinite-cache maximum (an unbounded LRU tier)
- sim_cache.py    CacheSim: what a request does to RAM and disk, in the daemon's order, under each
                  disk_write mode (commit, evict), admission and budget (`WritePlan`)
- sim_disk.py     SegmentLog: the disk tier's segments, reclamation and second chance
- sim_policy.py   the RAM tier under another policy (S3-FIFO): the daemon's own policy classes

RAM under LRU (kvstore/engine/ram_space.py): touches go first-block-first, so the head of a chain is older
than its tail and goes first: a chain can lose its head and keep an orphaned tail. A RAM tier offers
CacheSim three steps (free_slots, take_victim, insert_landed): the order of victims and inserts is CacheSim's,
the daemon's (a put's victims before its inserts; a probe's promotions a victim each before any lands; for
LRU the landing order changes nothing, the get re-touches the whole prefix in chain order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from bench.replay.keys import chain_keys
from bench.replay.sim_cache import CacheSim, RamTier, WritePlan
from bench.replay.sim_disk import PAGE_BYTES, REINSERT_SHARE, WRITER_BATCH_BLOCKS, SegmentLog
from bench.replay.sim_policy import PolicyTier
from bench.replay.trace import Convention, Request

__all__ = ["LRUTier", "PolicyTier", "RamTier", "SegmentLog", "SimTier", "CacheSim", "WritePlan", "SimResult",
           "simulate", "infinite_cache", "admit", "WRITER_BATCH_BLOCKS", "PAGE_BYTES", "REINSERT_SHARE"]


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
        """Hits, in order: each becomes the most recent."""
        move = self._od.move_to_end
        for k in keys:
            move(k)

    def _victim(self, keep: Collection[bytes]) -> bytes | None:
        """The entry eviction takes next, outside `keep` (None: nothing evictable); hints.HintedLRU refines it."""
        for k in self._od:  # least recent first
            if k not in keep:
                return k
        return None

    def _forget(self, key: bytes) -> None:
        del self._od[key]

    def free_slots(self) -> int:
        """Slots no entry holds (an unbounded tier: always enough)."""
        return (1 << 62) if self.capacity_blocks is None else self.capacity_blocks - len(self._od)

    def take_victim(self, keep: Collection[bytes]) -> bytes | None:
        """Evict the next victim outside `keep` (None: nothing evictable)."""
        v = self._victim(keep)
        if v is not None:
            self._forget(v)
        return v

    def insert_landed(self, keys: Sequence[bytes]) -> None:
        """Blocks that got a slot (a put's, promotions that landed), in that order, as most recent."""
        for k in keys:
            self._od[k] = None

    def admit(self, keys: Sequence[bytes], keep: Collection[bytes]) -> tuple[bool, list[bytes]]:
        """A put of absent keys when nothing is written back first: all victims, then the inserts, in order
        (stored?, victims)."""
        return admit(self, keys, keep)


def admit(tier: RamTier, keys: Sequence[bytes], keep: Collection[bytes]) -> tuple[bool, list[bytes]]:
    """Insert absent keys, in order, evicting outside `keep` first, all or nothing (what a Reserve whose victims
    all leave at once does): (stored?, victims in order). CacheSim does the same step by step (sim_cache.py)."""
    need = len(keys) - tier.free_slots()
    victims: list[bytes] = []
    while len(victims) < need and (v := tier.take_victim(keep)) is not None:
        victims.append(v)
    if len(victims) < need:
        return False, victims
    tier.insert_landed(keys)
    return True, victims


SimTier = LRUTier | PolicyTier | SegmentLog


@dataclass
class SimResult:
    """Per-request prefix hits in blocks (and which of them came from disk), and the model's counters."""

    hits: list[int]
    hits_by_tier: list[int]  # [RAM, disk] hit blocks over the run
    disk_hits: list[tuple[int, ...]] = field(default_factory=list)  # per request: positions served from disk
    stored_blocks: int = 0
    store_full: int = 0
    tier_names: list[str] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)  # per tier: RAM evictions, disk blocks reclaimed
    resident: list[int] = field(default_factory=list)  # blocks per tier at the end
    present_on_put: int = 0
    counters: dict[str, int] = field(default_factory=dict)  # the daemon's names, plus disk_* for the disk tier
    landing_mismatches: int = 0  # probes whose observed landings were not the model's promotions (landing.py)


def simulate(requests: Sequence[Request], tiers: Sequence[SimTier],
             convention: Convention = Convention.FULL_BLOCKS,
             on_hints: Callable[[CacheSim, Request, bool], None] | None = None,
             landed: Sequence[bytes] | None = None, plan: WritePlan | None = None) -> SimResult:
    """`on_hints(sim, request, before)` runs before each request's lookup and after its put (hints.py);
    `landed`: the promoted keys in the order the daemon's promoters landed them (landing.py; S3-FIFO);
    `plan`: when the disk tier is written (default: commit, admission always, no budget)."""
    sim = CacheSim(tiers, landed, plan)
    hits: list[int] = []
    disk_hits: list[tuple[int, ...]] = []
    stored = 0
    for r in requests:
        sim.now = r.timestamp_ms / 1000.0
        if on_hints is not None:
            on_hints(sim, r, True)
        keys = chain_keys(r.cacheable_ids(convention))
        found = sim.lookup(keys)
        hits.append(len(found))
        disk_hits.append(tuple(i for i, t in enumerate(found) if t) if sim.disk is not None else ())
        if len(found) < len(keys):
            stored += sim.put(keys[len(found):])
        if on_hints is not None:
            on_hints(sim, r, False)
    on_disk = sum(len(d) for d in disk_hits)
    counters = dict(sim.counters)
    evictions = [counters["evictions"]]
    if sim.disk is not None:
        d = sim.disk
        counters.update(disk_writes=d.written, disk_write_failures=d.no_space, disk_evicted_blocks=d.reclaimed,
                        disk_reinserted=d.reinserted, disk_cleaned=d.cleaned, disk_readmitted=sim.readmitted,
                        disk_blocks=len(d),
                        disk_bytes_written=(d.written + d.reinserted) * d.record_bytes,
                        disk_bytes_read=(sim.disk_reads + d.reinserted) * d.record_bytes)
        evictions.append(d.reclaimed)
    return SimResult(hits, [sum(hits) - on_disk, on_disk], disk_hits, stored, counters["store_full"],
                     [t.name for t in tiers], evictions, [len(t) for t in tiers], sim.present_on_put, counters,
                     sim.landing_mismatches)


def infinite_cache(requests: Sequence[Request], convention: Convention = Convention.FULL_BLOCKS) -> SimResult:
    """The maximum: a block hits whenever its whole prefix was seen before (nothing is ever evicted)."""
    return simulate(requests, [LRUTier("infinite", None)], convention)
