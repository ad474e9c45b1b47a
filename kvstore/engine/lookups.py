"""The steps of a Lookup across tiers; `Engine.lookup` runs them in order (called under the engine's lock).

For each key: in the arena (RAM hit) -> leased at once; being promoted -> joins that promotion; only on disk
-> a slot is allocated and a promotion started (disk_link.py). A Lookup without a lease (the scheduler's
probe) returns right away, counting disk hits as present: their promotion runs in the background, so the
later get finds them in RAM (prefetch). A Lookup with a lease (a get) waits up to `promote_timeout_s` for its
promotions, with no lock held, then leases what arrived; a promotion that failed (checksum, I/O error, no
room) is a miss.

Steps: `locate` (entry id and tier of each key) -> `ram_hits` when the hits are a RAM prefix (the common case,
nothing to wait for) or else `begin` (hold RAM hits, start or join promotions; it may answer at once) ->
[the engine waits for `Pending.promotions` with no lock held] -> `finish` (lease what arrived).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

import kvstore._native._keyindex as _keyindex
from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.engine.counters import Counters
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.leases import LeaseTable
from kvstore.engine.movement import Promotion
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.results import HitColumns, LookupResult
from kvstore.vocab import Tier

__all__ = ["Lookups", "Pending"]

# plain ints: numpy compares them far faster than IntEnum members
_NONE, _RAM, _DISK, _PEER = int(Tier.NONE), int(Tier.RAM), int(Tier.DISK), int(Tier.PEER)
_COMMITTED = int(EntryState.COMMITTED)
_TIER_OF_STATE = np.zeros(256, dtype=np.int8)  # an entry's state -> the tier a Lookup reports (uint8 states)
_TIER_OF_STATE[_COMMITTED] = _RAM
_TIER_OF_STATE[int(EntryState.PROMOTING)] = _DISK  # being promoted: a promotion to join


@dataclass
class Pending:
    """A leased Lookup between `begin` and `finish`: what it holds and the promotions it waits for."""

    eids: np.ndarray
    tiers: np.ndarray
    limit: int                       # keys past it are not looked at (prefix: the first key in no tier)
    ram: np.ndarray                  # indexes of the RAM hits (held since `begin`)
    promotions: dict[int, Promotion]  # key index -> promotion


class Lookups:
    """Lookup steps over the catalog, RAM space, lease table and disk link. Called under the engine's lock."""

    def __init__(self, cat: Catalog, ram: RamSpace, leases: LeaseTable, disk: DiskLink, counters: Counters) -> None:
        self._cat = cat
        self._ram = ram
        self._leases = leases
        self._disk = disk
        self._counters = counters

    def locate(self, ns: Namespace, keys: Sequence[bytes],
               at_peers: list[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Entry id (or -1) and tier of each key. PROMOTING counts as DISK (a promotion to join); a key only on
        disk gets minus its stored length as id (for `begin`); `at_peers` marks the peer tier's hits."""
        eids = np.fromiter(map(ns.index.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
        known = eids >= 0
        if known.all():
            tiers = _TIER_OF_STATE[self._cat.state[eids]]
        else:
            states = np.zeros(len(keys), dtype=np.uint8)  # FREE: no tier
            states[known] = self._cat.state[eids[known]]
            tiers = _TIER_OF_STATE[states]
            if self._disk.store is not None:
                missing = np.flatnonzero(~known)
                lengths = self._disk.contains_many(ns.name, [keys[i] for i in missing.tolist()])
                for i, length in zip(missing.tolist(), lengths):
                    if length:
                        tiers[i] = _DISK
                        eids[i] = -length
        if at_peers is not None:
            tiers[(tiers == _NONE) & np.array(at_peers, dtype=bool)] = _PEER
        return eids, tiers

    def holding(self, ns: Namespace, ids: np.ndarray, serials: np.ndarray) -> int:
        """How many leading (entry id, serial) pairs a client found in the shared key index still name this
        namespace's committed RAM entries, with the same serial (an id reused since is another block)."""
        cat = self._cat
        return int(_keyindex.check(ids, serials, cat.state, cat.ns, cat.serial, len(cat.keys), ns.id, _COMMITTED))

    def prior_hits(self, ns: Namespace, ids: np.ndarray, serials: np.ndarray, read: bool = False) -> tuple[int, int]:
        """A probe's leading keys as a client found them in the shared key index (entry id + serial each):
        how many lead that are still what the client saw (this namespace's, committed in RAM, same serial).
        Those count and touch exactly as `ram_hits` would count and touch them; what the client claimed past
        them is dropped (evicted in between: the answer is the one a Lookup would give now). `read`: the client
        copied those blocks out (a get), so their bytes count as handed to a reader, as a leased Lookup's do.
        Returns (k, the bytes read: 0 without `read`)."""
        k = self.holding(ns, ids, serials)
        hits = ids[:k].astype(np.int64)
        nbytes = int(self._cat.size[hits].sum()) if read else 0
        self._counters.hit_bytes_ram += nbytes
        self._ram.record_hits(hits)
        self._disk.note_hits(hits)
        counters = self._counters
        counters.lookup_keys += len(ids)
        ns.lookup_keys += len(ids)
        ns.hit_keys += k
        counters.hit_keys += k
        counters.hit_keys_ram += k
        return k, nbytes

    def probe_head(self, ns: Namespace, ids: np.ndarray, serials: np.ndarray,
                   n_tail: int, read: bool = False) -> tuple[int, LookupResult | None]:
        """Engine.probe's part under the lock: (how many leading entries hold, the answer when that is all of it:
        one of them no longer holds, or no keys follow them). Else the caller looks the tail up (`after_head`)."""
        k, nbytes = self.prior_hits(ns, ids, serials, read)
        if k < len(ids) or not n_tail:
            self._counters.lookup_calls += 1
            self._counters.lookup_keys += n_tail
            ns.lookup_keys += n_tail
            short = [False] if k < len(ids) + n_tail else []
            return k, LookupResult(k, [True] * k + short, [], [], [], [], 0, 0, [_RAM] * k + [_NONE] * len(short),
                                   read_bytes=nbytes)
        return k, None

    @staticmethod
    def after_head(k: int, tail: LookupResult) -> LookupResult:
        """A probe's answer: `k` leading entries in RAM, then the tail's prefix Lookup."""
        return LookupResult(k + tail.num_prefix, [True] * k + tail.present, [], [], [], [], 0, 0,
                            [_RAM] * k + tail.tiers)

    def entries(self, ns: Namespace, ids: np.ndarray, serials: np.ndarray, prefix: bool, lease: bool,
                summary: bool) -> LookupResult | None:
        """Engine.lookup_entries under the lock: the RAM-hit answer when every entry holds, else None (nothing done)."""
        n = len(ids)
        if not n or self.holding(ns, ids, serials) < n:
            return None
        return self.ram_hits(ns, [b""] * n, prefix, lease, ids.astype(np.int64), np.full(n, _RAM, dtype=np.int8), n,
                             summary)

    @staticmethod
    def ram_prefix(tiers: np.ndarray) -> int:
        """How many keys lead in RAM (`ram_hits` answers when that is all the hits there can be)."""
        in_ram = tiers == _RAM
        first = int(in_ram.argmin())  # the first key not in RAM (0 also when every key is)
        return len(tiers) if in_ram[first] else first

    def ram_hits(self, ns: Namespace, keys: Sequence[bytes], prefix: bool, lease: bool,
                 eids: np.ndarray, tiers: np.ndarray, limit: int, summary: bool = False) -> LookupResult:
        """The answer when the hits are exactly the first `limit` keys, all in RAM (nothing to promote or wait
        for): the same effects, in the same order, as `begin` + `_answer` on such a result, with what they
        compute known up front (the hit mask is `limit` leading Trues, no disk or peer hits)."""
        cat, counters, n_keys = self._cat, self._counters, len(keys)
        ids = eids[:limit].copy()
        self._ram.record_hits(ids)
        self._disk.note_hits(ids)
        if lease and limit:
            self._leases.hold(ids)
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
        cols = HitColumns(offsets, cat.size[ids], self._ram.generations(offsets), cat.checksum[ids])
        size_list = cols.sizes.tolist()
        if lease:
            counters.hit_bytes_ram += sum(size_list)
        lease_id = self._leases.grant(ids) if lease else 0
        return LookupResult(limit, present, offsets.tolist(), size_list, cols.generations.tolist(),
                            cols.checksums.tolist(), lease_id, self._leases.expires_in_ms if lease else 0,
                            tier_list, cols)

    def begin(self, ns: Namespace, keys: Sequence[bytes], prefix: bool, lease: bool, eids: np.ndarray,
              tiers: np.ndarray, summary: bool) -> LookupResult | Pending:
        """Hold the RAM hits, start or join promotions; the answer when nothing is left to wait for."""
        limit = _prefix_len(tiers) if prefix else len(keys)
        ram = np.flatnonzero(tiers[:limit] == _RAM)
        ram_ids = eids[ram]
        self._ram.record_hits(ram_ids)  # before any promotion evicts: the policy sees hits first
        self._disk.note_hits(ram_ids)
        if lease and len(ram_ids):
            self._leases.hold(ram_ids)  # hold RAM hits while we wait for promotions
        promos = self._promote(ns, keys, eids, tiers, limit, ram_ids)
        self._counters.lookup_calls += 1
        self._counters.lookup_keys += len(keys)
        ns.lookup_keys += len(keys)
        if not lease:
            found = (tiers[:limit] == _RAM) | (tiers[:limit] == _PEER)
            found[list(promos)] = True
            if prefix and not found.all():  # a promotion found no room: the prefix ends there, and so do its
                inside = ram < int(np.argmin(found))  # hits (a RAM hit past it would be a hit the reply
                ram, ram_ids = ram[inside], ram_ids[inside]  # cannot carry: "N hits among n keys")
            return self._answer(ns, keys, prefix, tiers, ram, ram_ids, lease=False, found=found, summary=summary)
        if not promos and (not prefix or len(ram) == limit):  # every hit in RAM, already held
            return self._answer(ns, keys, prefix, tiers, ram, ram_ids, lease=True)
        return Pending(eids, tiers, limit, ram, promos)

    def finish(self, ns: Namespace, keys: Sequence[bytes], prefix: bool, p: Pending) -> LookupResult:
        """After the wait: lease the promotions that arrived; with `prefix`, stop at the first miss."""
        cat, eids = self._cat, p.eids
        hit_idx: list[int] = []
        hit_ids: list[int] = []
        held = set(p.ram.tolist())
        for i in range(p.limit):
            if i in held:
                hit_idx.append(i)
                hit_ids.append(int(eids[i]))
                continue
            promo = p.promotions.get(i)
            # the entry may have been freed and its id reused since the promotion committed: by this key in
            # ANOTHER namespace too (keys do not depend on the namespace), hence the namespace check
            if (promo is not None and promo.ok and cat.state[promo.eid] == _COMMITTED
                    and cat.keys[promo.eid] == keys[i] and int(cat.ns[promo.eid]) == ns.id):
                cat.leases[promo.eid] += 1
                hit_idx.append(i)
                hit_ids.append(promo.eid)
            elif prefix:
                break
        if prefix:  # give back holds of RAM hits past the first miss
            extra = eids[p.ram[p.ram >= len(hit_idx)]]
            if len(extra):
                self._leases.unhold(extra)
        return self._answer(ns, keys, prefix, p.tiers, np.array(hit_idx, dtype=np.int64),
                            np.array(hit_ids, dtype=np.int64), lease=True)

    def _promote(self, ns: Namespace, keys: Sequence[bytes], eids: np.ndarray, tiers: np.ndarray,
                 limit: int, ram_ids: np.ndarray) -> dict[int, Promotion]:
        """Start (or join) a promotion for each disk-tier key before `limit`; index -> promotion.

        `ram_ids`: this lookup's RAM hits, which making room for the promotions must not evict."""
        promos: dict[int, Promotion] = {}
        disk = np.flatnonzero(tiers[:limit] == _DISK)
        if not len(disk):
            return promos
        started: dict[bytes, Promotion | None] = {}  # a key repeated in one lookup: one promotion, one slot
        self._disk.begin_promotions(set(ram_ids.tolist()))  # one group: read together (promotions.py)
        for i in disk.tolist():
            eid = int(eids[i])
            if eid >= 0:
                p = self._disk.promotion(eid)
            else:
                if keys[i] not in started:
                    started[keys[i]] = self._disk.start_promotion(ns, keys[i], -eid)
                p = started[keys[i]]
                eids[i] = p.eid if p is not None else -1
            if p is not None:
                promos[i] = p
        self._disk.end_promotions()
        return promos

    def _answer(self, ns: Namespace, keys: Sequence[bytes], prefix: bool, tiers: np.ndarray,
                hit_idx: np.ndarray, ids: np.ndarray, *, lease: bool, found: np.ndarray | None = None,
                summary: bool = False) -> LookupResult:
        """Build the result from the hits (key index + entry id, in order); vectorized: it runs per Lookup."""
        cat, counters = self._cat, self._counters
        mask = np.zeros(len(keys), dtype=bool)
        if found is None:
            mask[hit_idx] = True
        else:
            mask[: len(found)] = found
        n = int(np.argmin(mask)) if not mask.all() else len(keys)
        present = ([True] * n + ([False] if n < len(keys) else [])) if prefix else mask.tolist()
        looked = len(present)
        shown = mask[:looked]
        hits_all = int(shown.sum())
        hits_disk = int((shown & (tiers[:looked] == _DISK)).sum())
        hits_peer = int((shown & (tiers[:looked] == _PEER)).sum())
        ns.hit_keys += n if prefix else hits_all
        ns.hit_keys_disk += hits_disk  # with prefix, hits_all == n, so ns RAM hits = hit_keys - disk - peer
        ns.hit_keys_peer += hits_peer
        counters.hit_keys += hits_all
        counters.hit_keys_ram += hits_all - hits_disk - hits_peer
        counters.hit_keys_disk += hits_disk
        counters.hit_keys_peer += hits_peer
        tier_list = tiers[:looked].tolist()
        if not len(ids) or summary:
            return LookupResult(n, present, [], [], [], [], 0, 0, tier_list)
        offsets = cat.offset[ids]
        sizes = cat.size[ids]
        if lease:
            from_disk = tiers[hit_idx] == _DISK
            counters.hit_bytes_disk += int(sizes[from_disk].sum())
            counters.hit_bytes_ram += int(sizes[~from_disk].sum())
        cols = HitColumns(offsets, sizes, self._ram.generations(offsets), cat.checksum[ids])
        lease_id = self._leases.grant(ids) if lease else 0
        return LookupResult(n, present, offsets.tolist(), sizes.tolist(), cols.generations.tolist(),
                            cols.checksums.tolist(), lease_id, self._leases.expires_in_ms if lease else 0,
                            tier_list, cols)


def _prefix_len(tiers: np.ndarray) -> int:
    missing = np.flatnonzero(tiers == _NONE)
    return int(missing[0]) if len(missing) else len(tiers)
