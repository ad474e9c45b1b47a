"""The engine's reads across tiers and its side of the RAM <-> disk movement (a mixin of `Engine`).

Lookup, for each key: in the arena (RAM hit) -> leased at once; being promoted -> joins that promotion; only
on disk -> a slot is allocated and a promotion started. A Lookup without a lease (the scheduler's probe)
returns right away, counting disk hits as present: their promotion runs in the background, so the later get
finds them in RAM (prefetch). A Lookup with a lease (a get) waits up to `promote_timeout_s` for its
promotions, then leases what arrived; a promotion that failed (checksum, I/O error, no room) is a miss.

Write-behind: a block is queued for the disk writer when the admission policy accepts its use count (at
commit, or when a later hit raises the count). Its slot is held (leases + 1) only while the write runs. A
commit's blocks are queued in the commit's order (the order of the chain), not by entry id: the disk tier
appends them in that order, so a prefix chain lands in one segment (or consecutive ones) and ages out together.

Reclamation: the disk writer reports the blocks whose record a segment reclamation dropped (the disk tier's
second chance keeps those read since their write, see kvstore/tiers/disk/reclaim.py). A RAM copy of such a
block loses its ON_DISK mark (DISK_DROPPED: its eviction now drops the block, and is published as removed
from RAM, not moved to disk), and each is published as removed from the disk tier.

Every method that touches engine state runs under the engine lock; the hooks called from the mover threads
take it themselves. DiskStore calls made under the lock are index reads (one lmdb read txn per batch).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from kvstore.engine.catalog import DISK_DROPPED, ON_DISK, QUEUED, WRITING, EntryState, Namespace
from kvstore.engine.events import MOVED, REMOVED, STORED
from kvstore.engine.movement import Promotion
from kvstore.engine.results import HitColumns, LookupResult
from kvstore.tiers.disk import DiskStatus, WriteItem

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

__all__ = ["TieringMixin", "TIER_NONE", "TIER_RAM", "TIER_DISK", "TIER_PEER"]

TIER_NONE, TIER_RAM, TIER_DISK, TIER_PEER = 0, 1, 2, 3  # TIER_PEER: only in a Lookup without lease (prefetch)
_COMMITTED = int(EntryState.COMMITTED)
_PROMOTING = int(EntryState.PROMOTING)
_DOOMED = int(EntryState.DOOMED)
_TIER_OF_STATE = np.zeros(256, dtype=np.int8)  # an entry's state -> the tier a Lookup reports (uint8 states)
_TIER_OF_STATE[_COMMITTED] = TIER_RAM
_TIER_OF_STATE[_PROMOTING] = TIER_DISK       # being promoted: a promotion to join
_ONE = np.int32(1)  # the leases column's dtype: np.add.at stays on its fast path (~1 us for 280 ids, not ~16)


class TieringMixin:
    # -- lookup -----------------------------------------------------------------------------------------
    def lookup(self: Engine, ns_name: str, keys: Sequence[bytes], prefix: bool = False,
               lease: bool = True, local_only: bool = False, summary: bool = False) -> LookupResult:
        """`summary` (only without lease): the caller wants num_prefix, present and tiers, not where the hits
        are (a scheduler counting a prefix): the hit columns come back empty and are never built."""
        self._check_keys(keys)
        summary = summary and not lease
        at_peers = None
        if self._remote is not None and not local_only:  # peer tier first (no lock held)
            if lease:
                self._remote.fill(ns_name, keys)       # fetch local misses (joins prefetches in flight)
            else:
                at_peers = self._remote.prefetch(ns_name, keys, prefix)  # probe; fetch in the background
        with self._lock:
            ns = self._namespace(ns_name)
            eids, tiers = self._locate(ns, keys)
            if at_peers is not None:
                tiers[(tiers == TIER_NONE) & np.array(at_peers, dtype=bool)] = TIER_PEER
            in_ram = tiers == TIER_RAM
            first = int(in_ram.argmin())  # the first key not in RAM (0 also when every key is)
            if in_ram[first]:
                first = len(keys)
            if first == len(keys) or (prefix and tiers[first] == TIER_NONE):
                # the common case: the hits are the first `first` keys, all in RAM
                return self._lookup_ram(ns, keys, prefix, lease, eids, tiers, first, summary)
            limit = _prefix_len(tiers) if prefix else len(keys)
            ram = np.flatnonzero(tiers[:limit] == TIER_RAM)
            ram_ids = eids[ram]
            self._touches.record(ram_ids)  # before any promotion evicts: the policy sees hits first
            self._note_hits(ram_ids)
            if lease and len(ram_ids):
                np.add.at(self._cat.leases, ram_ids, _ONE)  # hold RAM hits while we wait for promotions
            promos = self._promote(ns, keys, eids, tiers, limit, ram_ids)
            self.counters.lookup_calls += 1
            self.counters.lookup_keys += len(keys)
            ns.lookup_keys += len(keys)
            if not lease:
                found = (tiers[:limit] == TIER_RAM) | (tiers[:limit] == TIER_PEER)
                found[list(promos)] = True
                return self._answer(ns, keys, prefix, tiers, ram, ram_ids, lease=False, found=found,
                                    summary=summary)
            if not promos and (not prefix or len(ram) == limit):  # every hit in RAM, already held
                return self._answer(ns, keys, prefix, tiers, ram, ram_ids, lease=True)
        deadline = time.monotonic() + self.config.promote_timeout_s
        for p in promos.values():
            p.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            cat = self._cat
            hit_idx: list[int] = []
            hit_ids: list[int] = []
            held = set(ram.tolist())
            for i in range(limit):
                if i in held:
                    hit_idx.append(i)
                    hit_ids.append(int(eids[i]))
                    continue
                p = promos.get(i)
                # the entry may have been freed and its id reused since the promotion committed: by this key in
                # ANOTHER namespace too (keys do not depend on the namespace), hence the namespace check
                if (p is not None and p.ok and cat.state[p.eid] == _COMMITTED and cat.keys[p.eid] == keys[i]
                        and int(cat.ns[p.eid]) == ns.id):
                    cat.leases[p.eid] += 1
                    hit_idx.append(i)
                    hit_ids.append(p.eid)
                elif prefix:
                    break
            if prefix:  # give back holds of RAM hits past the first miss
                n = len(hit_idx)
                extra = eids[ram[ram >= n]]
                if len(extra):
                    self._unlease(extra)
            return self._answer(ns, keys, prefix, tiers, np.array(hit_idx, dtype=np.int64),
                                np.array(hit_ids, dtype=np.int64), lease=True)

    def _locate(self: Engine, ns: Namespace, keys: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Entry id (or -1) and tier of each key. PROMOTING counts as TIER_DISK (a promotion to join)."""
        eids = np.fromiter(map(ns.index.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
        known = eids >= 0
        if known.all():
            tiers = _TIER_OF_STATE[self._cat.state[eids]]
            return eids, tiers
        states = np.zeros(len(keys), dtype=np.uint8)  # FREE: no tier
        states[known] = self._cat.state[eids[known]]
        tiers = _TIER_OF_STATE[states]
        if self._disk is not None:
            missing = np.flatnonzero(~known)
            lengths = self._disk.contains_many(ns.name, [keys[i] for i in missing.tolist()])
            for i, length in zip(missing.tolist(), lengths):
                if length:
                    tiers[i] = TIER_DISK
                    eids[i] = -length  # remembered for _promote: a negative id carries the length
        return eids, tiers

    def _lookup_ram(self: Engine, ns: Namespace, keys: Sequence[bytes], prefix: bool, lease: bool,
                    eids: np.ndarray, tiers: np.ndarray, limit: int, summary: bool = False) -> LookupResult:
        """Lookup when its hits are exactly the first `limit` keys, all in RAM (nothing to promote or wait for).

        The same effects, in the same order, as the general path of `lookup` + `_answer` on such a result,
        with what they compute known up front: the hit mask is `limit` leading Trues, no disk or peer hits."""
        cat, counters, n_keys = self._cat, self.counters, len(keys)
        ids = eids[:limit].copy()
        self._touches.record(ids)
        self._note_hits(ids)
        if lease and limit:
            np.add.at(cat.leases, ids, _ONE)
        counters.lookup_calls += 1
        counters.lookup_keys += n_keys
        ns.lookup_keys += n_keys
        misses = (1 if limit < n_keys else 0) if prefix else n_keys - limit
        present = [True] * limit + [False] * misses
        ns.hit_keys += limit
        counters.hit_keys += limit
        counters.hit_keys_ram += limit
        tier_list = tiers[: limit + misses].tolist()
        if not limit or summary:
            return LookupResult(limit, present, [], [], [], [], 0, 0, tier_list)
        offsets = cat.offset[ids]
        cols = HitColumns(offsets, cat.size[ids], self._gens[self._gen_index.of_many(offsets)], cat.checksum[ids])
        size_list = cols.sizes.tolist()
        if lease:
            counters.hit_bytes_ram += sum(size_list)
        lease_id = self._leases.add(ids) if lease else 0
        return LookupResult(limit, present, offsets.tolist(), size_list, cols.generations.tolist(),
                            cols.checksums.tolist(), lease_id, int(self.config.lease_ttl_s * 1000) if lease else 0,
                            tier_list, cols)

    def _promote(self: Engine, ns: Namespace, keys: Sequence[bytes], eids: np.ndarray, tiers: np.ndarray,
                 limit: int, ram_ids: np.ndarray) -> dict[int, Promotion]:
        """Start (or join) a promotion for each disk-tier key before `limit`; index -> promotion.

        `ram_ids`: this lookup's RAM hits, which making room for the promotions must not evict."""
        promos: dict[int, Promotion] = {}
        disk = np.flatnonzero(tiers[:limit] == TIER_DISK)
        if not len(disk):
            return promos
        keep = set(ram_ids.tolist())
        started: dict[bytes, Promotion | None] = {}  # a key repeated in one lookup: one promotion, one slot
        for i in disk.tolist():
            eid = int(eids[i])
            if eid >= 0:
                p = self._promotions.get(eid)
            else:
                if keys[i] not in started:
                    started[keys[i]] = self._start_promotion(ns, keys[i], -eid, keep)
                p = started[keys[i]]
                eids[i] = p.eid if p is not None else -1
            if p is not None:
                promos[i] = p
        return promos

    def _start_promotion(self: Engine, ns: Namespace, key: bytes, length: int, keep: set[int]) -> Promotion | None:
        off = self._allocate(length, keep, ns.tenant)
        if off is None:
            self.counters.promotion_failures += 1
            return None
        cat = self._cat
        eid = cat.add(ns, key, off, length)
        cat.state[eid] = _PROMOTING
        cat.flags[eid] = ON_DISK
        p = Promotion(eid, ns.name, key, self._arena_address + off, self._alloc.slot_bytes(length))
        self._promotions[eid] = p
        self._mover.enqueue_promotion(p)
        self.counters.promotions += 1
        return p

    def _answer(self: Engine, ns: Namespace, keys: Sequence[bytes], prefix: bool, tiers: np.ndarray,
                hit_idx: np.ndarray, ids: np.ndarray, *, lease: bool, found: np.ndarray | None = None,
                summary: bool = False) -> LookupResult:
        """Build the result from the hits (key index + entry id, in order); vectorized: it runs per Lookup."""
        cat = self._cat
        mask = np.zeros(len(keys), dtype=bool)
        if found is None:
            mask[hit_idx] = True
        else:
            mask[: len(found)] = found
        if prefix:
            n = int(np.argmin(mask)) if not mask.all() else len(keys)
            present = [True] * n + ([False] if n < len(keys) else [])
        else:
            present = mask.tolist()
            n = int(np.argmin(mask)) if not mask.all() else len(keys)
        looked = len(present)
        shown = mask[:looked]
        hits_all = int(shown.sum())
        hits_disk = int((shown & (tiers[:looked] == TIER_DISK)).sum())
        hits_peer = int((shown & (tiers[:looked] == TIER_PEER)).sum())
        ns.hit_keys += n if prefix else hits_all
        ns.hit_keys_disk += hits_disk  # with prefix, hits_all == n, so ns RAM hits = hit_keys - disk - peer
        ns.hit_keys_peer += hits_peer
        self.counters.hit_keys += hits_all
        self.counters.hit_keys_ram += hits_all - hits_disk - hits_peer
        self.counters.hit_keys_disk += hits_disk
        self.counters.hit_keys_peer += hits_peer
        tier_list = tiers[:looked].tolist()
        if not len(ids) or summary:
            return LookupResult(n, present, [], [], [], [], 0, 0, tier_list)
        offsets = cat.offset[ids]
        sizes = cat.size[ids]
        if lease:
            from_disk = tiers[hit_idx] == TIER_DISK
            self.counters.hit_bytes_disk += int(sizes[from_disk].sum())
            self.counters.hit_bytes_ram += int(sizes[~from_disk].sum())
        cols = HitColumns(offsets, sizes, self._gens[self._gen_index.of_many(offsets)], cat.checksum[ids])
        lease_id = self._leases.add(ids) if lease else 0
        return LookupResult(n, present, offsets.tolist(), sizes.tolist(), cols.generations.tolist(),
                            cols.checksums.tolist(), lease_id,
                            int(self.config.lease_ttl_s * 1000) if lease else 0, tier_list, cols)

    # -- admission and write-behind ---------------------------------------------------------------------
    def _note_hits(self: Engine, ids: np.ndarray) -> None:
        """Raise the use counts of RAM hits; queue the ones that just became admissible."""
        if self._disk is None or not len(ids):
            return
        cat = self._cat
        seen = cat.seen[ids]
        cat.seen[ids] = np.minimum(seen.astype(np.int16) + 1, 255)
        newly = ids[(cat.seen[ids] >= self._admission.threshold) & (cat.flags[ids] == 0)]
        self._queue_writes(newly)

    def _queue_writes(self: Engine, ids: np.ndarray) -> None:
        if self._disk is None or not len(ids):
            return
        cat = self._cat
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # each once, in the caller's (chain) order
        items = [(int(e), int(cat.ns[e]), cat.keys[e]) for e in ids.tolist()]
        accepted = self._mover.enqueue_writes(items)
        cat.flags[ids[:accepted]] |= QUEUED
        self.counters.demote_queue_full += len(items) - accepted

    def claim_writes(self: Engine, batch: list[tuple[int, int, bytes]]) -> tuple[list[WriteItem], list[int]]:
        """Writer thread: turn queued entries that still exist into write items and hold their slots."""
        items: list[WriteItem] = []
        eids: list[int] = []
        with self._lock:
            cat = self._cat
            for eid, ns_id, key in batch:
                live = (eid < len(cat.keys) and cat.state[eid] == _COMMITTED and int(cat.ns[eid]) == ns_id
                        and cat.keys[eid] == key and cat.flags[eid] & QUEUED)
                if not live:
                    self.counters.demote_dropped += 1  # evicted or deleted before the writer got to it
                    continue
                cat.flags[eid] = WRITING  # not 0: a hit meanwhile must not queue it again
                cat.leases[eid] += 1
                ns = cat.namespaces[ns_id]
                items.append(WriteItem(ns.name, key, self._arena_address + int(cat.offset[eid]), int(cat.size[eid]),
                                       ns.disk_codec))
                eids.append(eid)
        return items, eids

    def finish_writes(self: Engine, eids: list[int], statuses: list[DiskStatus]) -> list[tuple[str, bytes]]:
        """Writer thread: record results; returns (namespace, key) of blocks deleted during their write."""
        stale: list[tuple[str, bytes]] = []
        with self._lock:
            cat = self._cat
            for eid, status in zip(eids, statuses):
                cat.flags[eid] = 0  # a failed write may be retried by a later hit (admission runs again)
                if status is DiskStatus.OK:
                    cat.flags[eid] = ON_DISK
                    self.counters.disk_writes += 1
                    self.events.publish(STORED, cat.namespace_of(eid).name, [cat.keys[eid]], TIER_DISK)
                else:
                    self.counters.disk_write_failures += 1
                if cat.state[eid] == _DOOMED:
                    stale.append((cat.namespace_of(eid).name, cat.keys[eid]))
            if eids:
                self._unlease(np.array(eids, dtype=np.int64))
        return stale

    def finish_reclaim(self: Engine, dropped: list[tuple[str, bytes]], reinserted: int) -> None:
        """Writer thread: a write batch reclaimed segments; `dropped` (namespace, key) left the disk tier."""
        with self._lock:
            self.counters.disk_reinserted += reinserted
            if not dropped:
                return
            cat = self._cat
            by_ns: dict[str, list[bytes]] = {}
            for name, key in dropped:
                by_ns.setdefault(name, []).append(key)
            for name, keys in by_ns.items():
                ns = cat.by_name.get(name)
                if ns is not None:
                    for key in keys:
                        eid = ns.index.get(key)
                        if eid is not None and cat.flags[eid] & ON_DISK:
                            cat.flags[eid] = DISK_DROPPED
                self.events.publish(REMOVED, name, keys, TIER_DISK)

    def finish_promotion(self: Engine, p: Promotion, status: DiskStatus) -> None:
        """Promoter thread: the read into the slot ended; commit the entry or give the slot back."""
        with self._lock:
            cat = self._cat
            self._promotions.pop(p.eid, None)
            alive = cat.state[p.eid] == _PROMOTING and cat.keys[p.eid] == p.key
            if status is DiskStatus.OK and alive and not p.cancelled:
                self._touches.apply()
                cat.state[p.eid] = _COMMITTED
                cat.created[p.eid] = cat.now()
                ns = cat.namespace_of(p.eid)
                ns.blocks += 1
                ns.bytes += int(cat.size[p.eid])
                self._policy.on_insert(p.eid, hash(p.key) ^ ns.id)
                self.events.publish(MOVED, ns.name, [p.key], TIER_DISK, TIER_RAM)
                p.ok = True
            else:
                if alive:
                    cat.unindex(p.eid)
                    self._free(p.eid)
                self.counters.promotion_failures += 1
                if status is DiskStatus.CHECKSUM_ERROR:
                    self.counters.checksum_failures += 1
        p.done.set()


def _prefix_len(tiers: np.ndarray) -> int:
    missing = np.flatnonzero(tiers == TIER_NONE)
    return int(missing[0]) if len(missing) else len(tiers)
