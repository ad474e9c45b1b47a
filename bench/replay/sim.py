"""Offline exact simulation of the store: pure Python, no daemon, the same event order as the daemon.

Why exact and not "an LRU of about this size": the replay through the real daemon is checked against this
model request by request (and counter by counter), so the model copies the daemon's rules, corner cases
included. A request is the replayer's three calls, lookup_prefix -> (promotions land) -> get -> put:

RAM tier (exact LRU over block keys, kvstore/engine/engine.py):
- lookup: the leading blocks present in RAM or on disk form the hit prefix. Its RAM hits are touched in order
  first (the daemon defers these touches but applies them, in order, before any insert or eviction). Then each
  disk-only hit is promoted: it takes a RAM slot, evicting the least recent entry that is not one of this
  lookup's RAM hits and not itself being promoted; with nothing evictable the promotion fails and the prefix
  ends there. The get that follows re-touches the whole prefix in order (promoted blocks are RAM hits by
  then: the replayer waits for promotions to land, see replayer.py), so a request leaves its prefix as the
  most recent entries in chain order, whatever order the two promoter threads finished in.
- put: only blocks present nowhere (neither RAM nor disk: Reserve answers ALREADY_PRESENT for both) are
  inserted, in order, as most recent; blocks present in RAM are not touched and cannot be evicted for this put
  (the engine's `keep` set). Like Reserve it is all or nothing: when too few entries are evictable the victims
  already taken stay evicted and nothing is stored. Because touches go first-block-first, the head of a chain
  is older than its tail and goes first: a chain can lose its head and keep an orphaned tail.
- eviction of a block that has a disk copy (written or promoted) only drops the RAM copy (`evicted_to_disk`).

Disk tier (`SegmentLog`, kvstore/tiers/disk/segments.py + writer.py):
- write-behind: every stored block is written once, in the writer's batches of 16, in the put's (chain)
  order (kvstore/engine/disk_link.py, DiskLink.queue_writes, keeps the commit's order); the replayer waits
  for the writer after each put, so no block is evicted before its write. Promoted blocks are not rewritten.
- space: each record takes round_up(block, 4 KiB) in the active segment; a full segment is sealed and a free
  one (or, when none is left, the OLDEST sealed one) becomes active; a batch never reclaims a segment it wrote
  into itself (NO_SPACE: tiers.py sizes segments so that this cannot happen).
- second chance (kvstore/tiers/disk/reclaim.py, `reinsert_hits`): every promotion is a verified read of the
  block's record. When a segment is reclaimed, its records read at least `reinsert_hits` times since their
  (re)write are copied first, in write order, to the start of that same segment, which becomes the active
  one: at most half a segment of them (REINSERT_SHARE); their read counts start again at 0. The others leave
  the tier (`reclaimed`). reinsert_hits 0: plain FIFO by segment.
- a block whose record was dropped loses the "on disk" mark of its RAM copy (the engine's DISK_DROPPED), so
  its later RAM eviction is not `evicted_to_disk`; the daemon does not rewrite it.

An unbounded LRU tier (capacity None) gives the infinite-cache maximum.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from bench.replay.keys import chain_keys
from bench.replay.sim_policy import PolicyTier
from bench.replay.trace import Convention, Request

__all__ = ["LRUTier", "PolicyTier", "RamTier", "SegmentLog", "SimTier", "CacheSim", "SimResult", "simulate",
           "infinite_cache", "WRITER_BATCH_BLOCKS", "PAGE_BYTES", "REINSERT_SHARE"]

WRITER_BATCH_BLOCKS = 16  # kvstore.engine.movement.Mover: blocks one write_many call takes from the queue
PAGE_BYTES = 4096  # every disk record starts on a page and is rounded up to whole pages
REINSERT_SHARE = 0.5  # kvstore.tiers.disk.reclaim: most of a reclaimed segment its kept records may fill


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

    def admit(self, keys: Sequence[bytes], keep: Collection[bytes]) -> tuple[bool, list[bytes]]:
        """Insert absent keys as most recent, in order, evicting outside `keep`: (stored?, victims in order)."""
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

    def promote(self, keys: Sequence[bytes], keep: Collection[bytes],
                landing: Callable[[list[bytes]], list[bytes]] | None = None) -> tuple[list[bool], list[bytes]]:
        """A probe's promotions, in order: each a one-key admit that evicts outside `keep` and the promotions
        before it (the get re-touches the prefix, so the order they land in changes nothing for LRU)."""
        keep = set(keep)
        oks: list[bool] = []
        victims: list[bytes] = []
        for k in keys:
            ok, v = self.admit([k], keep)
            victims += v
            oks.append(ok)
            if ok:
                keep.add(k)
        return oks, victims


class SegmentLog:
    """The daemon's disk tier: a log of `segments` segments of `segment_bytes`, reclaimed oldest first, keeping
    the records read at least `reinsert_hits` times since their write (0: plain FIFO)."""

    def __init__(self, name: str, segments: int, segment_bytes: int, block_bytes: int,
                 batch_blocks: int = WRITER_BATCH_BLOCKS, reinsert_hits: int = 1) -> None:
        self.record_bytes = -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
        if segments < 2 or self.record_bytes > segment_bytes:
            raise ValueError(f"tier {name}: need >= 2 segments that each hold a {self.record_bytes}-byte record")
        self.name = name
        self.segments, self.segment_bytes, self.batch_blocks = segments, segment_bytes, batch_blocks
        self.reinsert_hits = reinsert_hits
        self.keep_max = int(segment_bytes * REINSERT_SHARE) // self.record_bytes  # kept records per reclamation
        self.capacity_blocks: int | None = segments * (segment_bytes // self.record_bytes)
        self._where: dict[bytes, int] = {}  # key -> the segment use holding it
        self._members: dict[int, list[bytes]] = {}  # segment use -> keys written into it, in offset order
        self._reads: dict[bytes, int] = {}  # key -> verified reads of its record since it was (re)written
        self._sealed: deque[int] = deque()  # oldest first
        self._active: int | None = None
        self._wp = 0
        self._free = segments
        self._uses = 0
        self.dropped: list[bytes] = []  # keys reclamation dropped since the caller last emptied this list
        self.written = self.reclaimed = self.reinserted = self.no_space = 0

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def read(self, key: bytes) -> None:
        """A verified read of the key's record (a promotion)."""
        self._reads[key] = self._reads.get(key, 0) + 1

    def write(self, keys: Sequence[bytes]) -> list[bool]:
        """Append records in order, batch by batch (writer.py's _reserve); whether each was written."""
        out: list[bool] = []
        for start in range(0, len(keys), self.batch_blocks):
            touched: set[int] = set()
            for k in keys[start:start + self.batch_blocks]:
                ok = self._place(k, touched)
                out.append(ok)
                self.written += ok
                self.no_space += not ok
        return out

    def _place(self, key: bytes, touched: set[int]) -> bool:
        while self._active is None or self._wp + self.record_bytes > self.segment_bytes:
            if self._active is not None:
                self._sealed.append(self._active)  # seal the full one
                self._active = None
            keep: list[bytes] = []
            if self._free:
                self._free -= 1
            elif self._sealed and self._sealed[0] not in touched:
                keep = self._reclaim(self._sealed.popleft())
            else:
                return False  # this batch alone fills the tier: NO_SPACE
            self._uses += 1
            self._active, self._wp = self._uses, 0
            self._members[self._active] = []
            for k in keep:  # copied to the start of the reclaimed segment, now the active one
                self._append(k)
                self.reinserted += 1
            if keep:
                touched.add(self._active)
        old = self._where.get(key)
        if old is not None:  # a rewrite replaces the older record (not reached by the replay's puts)
            self._members[old].remove(key)
        self._append(key)
        touched.add(self._active)
        return True

    def _append(self, key: bytes) -> None:
        self._where[key] = self._active  # type: ignore[assignment]  # _append runs with a segment active
        self._members[self._active].append(key)  # type: ignore[index]  # _append runs with a segment active
        self._wp += self.record_bytes
        self._reads.pop(key, None)

    def _reclaim(self, use: int) -> list[bytes]:
        """Take the segment use `use` back: the records to keep (write order); the others leave the tier."""
        keep: list[bytes] = []
        for k in self._members.pop(use):
            if self.reinsert_hits and self._reads.get(k, 0) >= self.reinsert_hits and len(keep) < self.keep_max:
                keep.append(k)
                continue
            del self._where[k]
            self._reads.pop(k, None)
            self.dropped.append(k)
            self.reclaimed += 1
        return keep


RamTier = LRUTier | PolicyTier
SimTier = LRUTier | PolicyTier | SegmentLog


class CacheSim:
    """RAM (an LRUTier, or a PolicyTier: S3-FIFO) and optionally a disk tier (a SegmentLog), driven with the
    connector's calls."""

    def __init__(self, tiers: Sequence[SimTier], landed: Sequence[bytes] | None = None) -> None:
        if not tiers or not isinstance(tiers[0], (LRUTier, PolicyTier)):
            raise ValueError("CacheSim needs a RAM tier first (an LRUTier or a PolicyTier)")
        if len(tiers) > 2 or (len(tiers) == 2 and not isinstance(tiers[1], SegmentLog)):
            raise ValueError("CacheSim models RAM and at most one disk tier (a SegmentLog) below it")
        self.ram: RamTier = tiers[0]
        self.disk: SegmentLog | None = tiers[1] if len(tiers) == 2 else None  # type: ignore[assignment]  # checked above: tiers[1] is a SegmentLog
        self._flagged: set[bytes] = set()  # RAM entries marked "on disk" (written or promoted, not dropped since)
        # the daemon's counter names (kvstore/engine/counters.py), so store and model compare one to one
        self.counters = dict.fromkeys(("evictions", "evicted_to_disk", "promotions", "promotion_failures",
                                       "hit_keys_ram", "hit_keys_disk", "store_full"), 0)
        self.present_on_put = 0  # blocks a put found already stored (RAM or disk)
        self._landed = landed  # the daemon's promotions in landing order (landing.py); None: chain order
        self._landed_at = 0
        self.landing_mismatches = 0  # probes whose landed keys were not the ones the model promoted

    def _landing(self, got: list[bytes]) -> list[bytes]:
        """The next len(got) landed keys, when they are `got` (else chain order, counted as a mismatch)."""
        if self._landed is None:
            return got
        start, self._landed_at = self._landed_at, self._landed_at + len(got)
        order = list(self._landed[start:self._landed_at])
        if sorted(order) != sorted(got):
            self.landing_mismatches += 1
            return got
        return order

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """lookup_prefix, promotions, then the get: the tier of each hit (0 RAM, 1 disk); its length is the hit."""
        ram, disk, c = self.ram, self.disk, self.counters
        found: list[int] = []
        for k in keys:
            if k in ram:
                found.append(0)
            elif disk is not None and k in disk:
                found.append(1)
            else:
                break
        held = [k for k, t in zip(keys, found) if t == 0]
        ram.touch(held)
        n = len(found)
        on_disk = [i for i, t in enumerate(found) if t]
        if on_disk:  # promotions: a slot each outside this probe's RAM hits (and the blocks being promoted)
            oks, victims = ram.promote([keys[i] for i in on_disk], held, self._landing)
            self._evicted(victims)
            for i, ok in zip(on_disk, oks):
                if ok:
                    self._flagged.add(keys[i])
                    disk.read(keys[i])  # type: ignore[union-attr]  # a disk hit implies a disk tier
                    c["promotions"] += 1
                else:
                    c["promotion_failures"] += 1
                    n = min(n, i)
        disk_hits = sum(found[:n])
        c["hit_keys_disk"] += disk_hits
        c["hit_keys_ram"] += (n - disk_hits) + n  # the probe's RAM hits, then the get's (all in RAM by then)
        ram.touch(keys[:n])
        return found[:n]

    def put(self, keys: Sequence[bytes]) -> int:
        """Insert the blocks of `keys` stored nowhere; write them to disk; how many were stored."""
        ram, disk = self.ram, self.disk
        in_ram = {k for k in keys if k in ram}
        present = in_ram | ({k for k in keys if k in disk} if disk is not None else set())
        new = [k for k in keys if k not in present]
        if new and not self._ram_admit(new, in_ram):
            self.counters["store_full"] += 1
            return 0  # like a failed Reserve, which reports nothing about the keys it found
        self.present_on_put += len(present)
        if disk is not None and new:
            self._flagged.update(k for k, ok in zip(new, disk.write(new)) if ok)
            self._flagged.difference_update(disk.dropped)  # the engine hears of them after the batch
            disk.dropped.clear()
        return len(new)

    def _ram_admit(self, keys: Sequence[bytes], keep: Collection[bytes]) -> bool:
        stored, victims = self.ram.admit(keys, keep)  # all victims first, then the inserts, like Reserve
        self._evicted(victims)
        return stored

    def _evicted(self, victims: Sequence[bytes]) -> None:
        self.counters["evictions"] += len(victims)
        for v in victims:
            if v in self._flagged:
                self._flagged.discard(v)
                self.counters["evicted_to_disk"] += 1


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
             landed: Sequence[bytes] | None = None) -> SimResult:
    """`on_hints(sim, request, before)` runs before each request's lookup and after its put (hints.py);
    `landed`: the promoted keys in the order the daemon's promoters landed them (landing.py; S3-FIFO)."""
    sim = CacheSim(tiers, landed)
    hits: list[int] = []
    disk_hits: list[tuple[int, ...]] = []
    stored = 0
    for r in requests:
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
                        disk_reinserted=d.reinserted, disk_blocks=len(d),
                        disk_bytes_written=(d.written + d.reinserted) * d.record_bytes,
                        disk_bytes_read=(counters["promotions"] + d.reinserted) * d.record_bytes)
        evictions.append(d.reclaimed)
    return SimResult(hits, [sum(hits) - on_disk, on_disk], disk_hits, stored, counters["store_full"],
                     [t.name for t in tiers], evictions, [len(t) for t in tiers], sim.present_on_put, counters,
                     sim.landing_mismatches)


def infinite_cache(requests: Sequence[Request], convention: Convention = Convention.FULL_BLOCKS) -> SimResult:
    """The maximum: a block hits whenever its whole prefix was seen before (nothing is ever evicted)."""
    return simulate(requests, [LRUTier("infinite", None)], convention)
