"""The store model of the simulator: a RAM tier and at most one disk tier, driven with the connector's calls in the
daemon's order (kvstore/engine: lookups.py, writes.py, ram_space.py, disk_link.py, promotions.py).

A request is the replayer's calls: the probe (a prefix Lookup without lease), the promotions it starts, the get
(a leased Lookup of the hit keys) and the put of the rest:

- probe: the leading blocks present in RAM or on disk form the hit prefix. Its RAM hits are touched in order
  (the daemon defers these touches but applies them, in order, before any insert or eviction) and their use
  counts rise. Each disk-only hit then needs a RAM slot: a free one, or the victim the policy picks among the
  entries that are not this probe's RAM hits; with nothing evictable the promotion fails and the prefix ends
  there. Victims are handled as any eviction (below). Under disk_write = evict a victim's write-back comes
  before any read of the probe's promotions (promotions.py: a group is read once all its room is made), so a
  write-back that reclaims the segment of a block about to be promoted makes that promotion fail (its read
  finds nothing: counted, its slot freed) although the probe counted it. Promoted blocks join the policy in
  the order they landed (chain order, or what landing.py recorded).
- get: every key of the probe's prefix still present (all in RAM by then) is touched in order and counted
  again; a promotion that failed its read is the first miss.
- put: only blocks present nowhere (neither RAM nor disk: Reserve answers ALREADY_PRESENT for both) are
  inserted, in order; blocks present in RAM cannot be evicted for this put. Like Reserve it is all or
  nothing: when too few entries are evictable the victims already taken stay evicted (and written, under
  evict) and nothing is stored.

Evictions (`_evict`), per mode (`WritePlan`, the daemon's disk_write, disk_admission and disk_write_budget):
- a victim with a disk copy (written, or promoted: it keeps its copy) leaves RAM only (`evicted_to_disk`);
- commit: any other victim is dropped. Blocks are written at commit if admission takes a first use (always),
  or when a hit makes them admissible (seen:N), in the order they were queued, after the probe's promotions
  landed (the daemon's writer lets reads go first: movement.py); a queued block evicted first is not written.
- evict: a victim admission takes (its use count: 1 at the put, +1 per RAM hit; 0 for a promoted block) and
  the budget admits is written back, in victim order, before its slot is reused; one a Release let go of, or
  refused, is dropped (`evicted_unwritten`). A block whose disk copy reclamation dropped is written again,
  admission not asked (the budget is).
A block whose record reclamation drops loses its disk mark; under commit it is then never queued again.
The budget (kvstore/policies/write_budget.py, the daemon's own class) runs on the trace's clock here: the
daemon's runs on its own, so the store equals this model only without a budget.

Release (hints.py: `let_go`) deletes the block's disk copy and marks its RAM copy: written nowhere.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from bench.replay.sim_disk import SegmentLog
from kvstore.policies.write_budget import WriteBudget

__all__ = ["CacheSim", "WritePlan", "RamTier"]


@runtime_checkable
class RamTier(Protocol):
    """What CacheSim asks of a RAM tier (sim.LRUTier, sim_policy.PolicyTier and their hinted forms)."""

    name: str
    capacity_blocks: int | None

    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def touch(self, keys: Sequence[bytes]) -> None: ...  # hits, in order
    def free_slots(self) -> int: ...  # slots no entry holds
    def take_victim(self, keep: Collection[bytes]) -> bytes | None: ...  # the next victim outside keep, forgotten
    def insert_landed(self, keys: Sequence[bytes]) -> None: ...  # blocks that got a slot, in this order


@dataclass(frozen=True)
class WritePlan:
    """When the disk tier is written: disk_write (commit | evict), the admission threshold (always 1, seen:N N,
    never 256) and an optional budget (bytes per second, window seconds) on the trace's clock."""

    mode: str = "commit"
    admission: int = 1
    budget: tuple[int, float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("commit", "evict"):
            raise ValueError(f"disk_write {self.mode!r}: use commit or evict")


class CacheSim:
    """RAM (an LRUTier, or a PolicyTier: S3-FIFO) and optionally a disk tier (a SegmentLog), driven with the
    connector's calls."""

    def __init__(self, tiers: Sequence[RamTier | SegmentLog], landed: Sequence[bytes] | None = None,
                 plan: WritePlan | None = None) -> None:
        ram = tiers[0] if tiers else None
        if not isinstance(ram, RamTier) or isinstance(ram, SegmentLog):
            raise ValueError("CacheSim needs a RAM tier first (an LRUTier or a PolicyTier)")
        disk = tiers[1] if len(tiers) == 2 else None
        if len(tiers) > 2 or (len(tiers) == 2 and not isinstance(disk, SegmentLog)):
            raise ValueError("CacheSim models RAM and at most one disk tier (a SegmentLog) below it")
        self.ram: RamTier = ram
        self.disk: SegmentLog | None = disk if isinstance(disk, SegmentLog) else None
        self.plan = plan or WritePlan()
        self.now = 0.0  # the trace's clock (seconds), set per request: the budget's
        self.budget = (WriteBudget(self.plan.budget[0], self.plan.budget[1], clock=lambda: self.now)
                       if self.plan.budget is not None and self.disk is not None else None)
        self._flagged: set[bytes] = set()  # RAM entries marked "on disk" (written or promoted, not dropped since)
        self._dropped: set[bytes] = set()  # RAM entries whose disk copy reclamation dropped (DISK_DROPPED)
        self._let_go: set[bytes] = set()  # RAM entries a Release let go of (written nowhere)
        self._seen: dict[bytes, int] = {}  # RAM entries' use counts (admission)
        self._queue: list[bytes] = []  # commit: blocks queued by hits, written once the probe's promotions land
        if self.disk is not None and self.plan.mode == "evict":
            self.disk.resident = lambda k: k in self._flagged
        # the daemon's counter names (kvstore/engine/counters.py), so store and model compare one to one
        self.counters = dict.fromkeys(("evictions", "evicted_to_disk", "promotions", "promotion_failures",
                                       "hit_keys_ram", "hit_keys_disk", "store_full", "disk_writes_queued",
                                       "disk_writebacks", "evicted_unwritten", "room_waits", "demote_dropped"), 0)
        self.present_on_put = 0  # blocks a put found already stored (RAM or disk)
        self.disk_reads = 0  # verified reads of records (promotions that found theirs)
        self.readmitted = 0  # victims admission would refuse, written because reclamation had dropped their copy
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

    # -- the connector's calls ------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The probe, its promotions, then the get: the tier of each hit (0 RAM, 1 disk); its length is the hit."""
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
        self._hits(held)
        n = len(found)
        on_disk = [i for i, t in enumerate(found) if t]
        failed: set[int] = set()
        if on_disk:
            failed, n = self._promote(keys, on_disk, held, n)
        c["hit_keys_disk"] += sum(1 for i in on_disk if i < n)
        c["hit_keys_ram"] += n - sum(1 for i in on_disk if i < n)  # the probe's RAM hits
        got = [k for i, k in enumerate(keys[:n]) if i not in failed]  # the get: all present are in RAM by now
        c["hit_keys_ram"] += len(got)
        ram.touch(got)
        self._hits(got)
        self._write(self._queue)  # commit: what hits queued, written after the promotions (and before the put)
        self._queue = []
        hit = min(failed) if failed else n
        return found[:hit]

    def _promote(self, keys: Sequence[bytes], on_disk: list[int], held: list[bytes],
                 n: int) -> tuple[set[int], int]:
        """The probe's promotions (promotions.py): a slot each in chain order (a free one, or one victim: freed at
        once, or written back first), then the write-backs, then the reads. Returns the positions whose read
        failed and the probe's prefix length (it ends at a promotion that found no room at all)."""
        disk, c = self.disk, self.counters
        assert disk is not None  # a disk hit implies a disk tier
        free = self.ram.free_slots()
        started: list[int] = []
        writes: list[bytes] = []
        for i in on_disk:
            if free > 0:
                free -= 1
            else:
                v = self.ram.take_victim(held)
                if v is None:  # nothing evictable: this promotion fails, the probe's prefix ends here
                    c["promotion_failures"] += 1
                    n = min(n, i)
                    continue
                writes += self._evict([v])  # freed at once, or written back before any read of the group
            c["promotions"] += 1
            started.append(i)
        self._write_back(writes)
        landed, failed = [], set()
        for i in started:
            k = keys[i]
            if k in disk:
                disk.read(k)
                self.disk_reads += 1
                landed.append(k)
            else:  # a write-back's reclamation dropped its record before the read: a miss, its slot freed
                c["promotion_failures"] += 1
                failed.add(i)
        order = self._landing(landed)
        self.ram.insert_landed(order)
        for k in order:
            self._flagged.add(k)
            self._seen[k] = 0
        return {i for i in failed if i < n}, n

    def put(self, keys: Sequence[bytes]) -> int:
        """Reserve + Commit of the blocks of `keys` stored nowhere (and their writes, per the mode); how many were
        stored. Reserve (ram_space.allocate_all): a slot per new block, in order, a free one or one victim each;
        when victims are being written back it waits for them and tries again, planning anew (a write-back may
        have reclaimed the disk copy of a block this put had found on disk: it needs a slot now)."""
        ram, disk = self.ram, self.disk
        while True:
            in_ram = {k for k in keys if k in ram}
            present = in_ram | ({k for k in keys if k in disk} if disk is not None else set())
            new = [k for k in keys if k not in present]
            if not new:
                break
            writes, short = self._allocate(len(new), in_ram)
            if writes:
                self.counters["room_waits"] += 1  # the Reserve waits for them, then plans again
                self._write_back(writes)
                continue
            if short:
                self.counters["store_full"] += 1
                return 0  # like a failed Reserve, which reports nothing about the keys it found
            ram.insert_landed(new)
            for k in new:
                self._seen[k] = 1
            if disk is not None and self.plan.mode == "commit" and self.plan.admission <= 1:
                self._write(self._queued(new))
            break
        self.present_on_put += len(present)
        return len(new)

    def _allocate(self, count: int, keep: Collection[bytes]) -> tuple[list[bytes], bool]:
        """A Reserve's pass (ram_space.allocate_all with one block a slot): the victims to write back, and whether
        it ran out of victims. It stops at the first block nothing can be evicted for, unless a victim is being
        written back: then it goes on choosing for the rest (and will try again)."""
        free, short = self.ram.free_slots(), False
        writes: list[bytes] = []
        for _ in range(count):
            if free > 0:
                free -= 1
                continue
            v = self.ram.take_victim(keep)
            if v is None:
                short = True
                if not writes:
                    break
                continue
            writes += self._evict([v])
        return writes, short

    # -- hints (hints.apply_hint) ---------------------------------------------------------------------
    def let_go(self, key: bytes) -> None:
        """A Release: its disk copy is deleted, its RAM copy (if any) is written nowhere."""
        if self.disk is None:
            return
        self.disk.remove(key)
        self._flagged.discard(key)
        self._dropped.discard(key)
        if key in self.ram:
            self._let_go.add(key)
            if key in self._queue:  # the writer will find it let go of (disk_link.claim_writes)
                self._queue.remove(key)
                self.counters["demote_dropped"] += 1

    def keep_again(self, key: bytes) -> None:
        """A Retain or Pin after a Release: the block may be written again."""
        self._let_go.discard(key)

    # -- evictions and writes -------------------------------------------------------------------------
    def _hits(self, keys: Sequence[bytes]) -> None:
        """RAM hits raise use counts; under commit, the ones that just became admissible are queued."""
        if self.disk is None:
            return
        seen, newly = self._seen, []
        for k in keys:
            seen[k] = min(seen.get(k, 0) + 1, 255)
            if (self.plan.mode == "commit" and seen[k] >= self.plan.admission and k not in self._flagged
                    and k not in self._dropped and k not in self._let_go and k not in self._queue):
                newly.append(k)
        self._queue += self._queued(newly)

    def _queued(self, keys: list[bytes]) -> list[bytes]:
        """The keys the budget admits, counted as queued for the writer."""
        out = self._offer(keys)
        self.counters["disk_writes_queued"] += len(out)
        return out

    def _offer(self, keys: list[bytes]) -> list[bytes]:
        """The keys the budget admits (all, without one), each offered once, in order."""
        if self.budget is None or not keys:
            return keys
        assert self.disk is not None
        return [k for k in keys if self.budget.admit(self.disk.record_bytes)]

    def _evict(self, victims: Sequence[bytes]) -> list[bytes]:
        """Victims leave RAM (see the module docstring); the ones to write back first, in order (evict)."""
        c, plan = self.counters, self.plan
        c["evictions"] += len(victims)
        out: list[bytes] = []
        for v in victims:
            seen = self._seen.pop(v, 0)
            let_go, dropped = v in self._let_go, v in self._dropped
            self._let_go.discard(v)
            self._dropped.discard(v)
            if v in self._queue:  # queued and evicted before the writer claimed it
                self._queue.remove(v)
                c["demote_dropped"] += 1
            if v in self._flagged:
                self._flagged.discard(v)
                c["evicted_to_disk"] += 1
            elif self.disk is not None and plan.mode == "evict":
                if let_go or (seen < plan.admission and not dropped):
                    c["evicted_unwritten"] += 1
                    continue
                self.readmitted += dropped and seen < plan.admission  # admission not asked again
                if self._offer([v]):
                    out.append(v)  # (counted as queued by _write_back)
                else:
                    c["evicted_unwritten"] += 1
        return out

    def _write_back(self, keys: list[bytes]) -> None:
        """Victims written before their slot is reused (evict); they leave RAM for the disk."""
        if not keys:
            return
        self.counters["disk_writebacks"] += len(keys)
        self.counters["disk_writes_queued"] += len(keys)
        self.counters["evicted_to_disk"] += sum(self._write(keys))

    def _write(self, keys: list[bytes]) -> list[bool]:
        """Write queued `keys` in order (the writer's batches); under commit their RAM copies gain the disk mark.
        Records reclamation dropped meanwhile lose theirs."""
        if not keys:
            return []
        assert self.disk is not None
        oks = self.disk.write(keys)
        if self.plan.mode == "commit":
            self._flagged.update(k for k, ok in zip(keys, oks) if ok)
        for k in self.disk.dropped:  # the engine hears of them after the batch
            if k in self._flagged:
                self._flagged.discard(k)
                self._dropped.add(k)
        self.disk.dropped.clear()
        return oks

