"""The engine: reservations, commits, leases, eviction, and the movement between the RAM and disk tiers.

Metadata only; clients (and the disk I/O threads) move the bytes. Primitives and their contracts (statuses are
exceptions from kvstore.errors; see each method):

- reserve(ns, keys, sizes): slots for every key not present yet (in RAM or on disk), all or nothing
  (StoreFullError). Reserved slots are invisible until commit and never evicted. Under disk_write=evict a
  victim may have to be written to disk before its slot is free: the Reserve then waits for those writes
  with no lock held (up to promote_timeout_s; counted in room_waits) and tries again.
- commit(rid, checksums) / abort(rid): end a reservation (ReservationClosedError if it already ended,
  UnknownReservationError if it never existed). A reservation that outlives its TTL is expired and its slots
  quarantined (reservations.py). A commit queues admitted blocks for the disk writer (disk_link.py). Store is
  both in one step, into slots a connection holds ahead (spare / store / drop_spares; spares.py, writes.py).
- lookup(ns, keys, prefix, lease): present keys in any tier; RAM hits are leased, disk hits are promoted into
  the arena (a get waits for them; lookups.py). A leased slot is never evicted or reused; a lease that
  outlives its TTL is dropped, and a reader that copied past that point sees the slot's generation changed
  (bumped on every free) and treats its copy as a miss (leases.py).
- release(lease_ids), exists, delete (every tier; a leased block is hidden at once, freed at its last
  release), pin/unpin (pinned blocks are never evicted), clear_namespace, list_keys/describe/stats (views.py),
  sweep(now). note_checksums(lease, offsets, sums): remember a reader's xxh3 of leased blocks committed
  without one (leases.py). explain(ns, keys): where each key lives, or why it is absent (misses.py); a prefix
  Lookup that stops short counts its first miss's cause (misses_* counters). hint(ns, keys, action, ttl_s):
  hints.py.

The engine is the composition root and the orchestrator: it holds the one lock and calls small parts that own
their state, each "called under the engine's lock":

    catalog.py       Catalog: entry columns and namespace indexes (the shared data model)
    namespaces.py    NamespaceTable: registration rules, lookup by name, owners
    ram_space.py     RamSpace: allocator, generations, policy, quotas (allocate / evict / free / watermarks)
    leases.py        LeaseTable: lease ids, per-entry holds, expiry
    reservations.py  ReservationTable: open reservations, TTL, quarantine, closed history
    spares.py        SpareSlots: slots a same-node connection holds ahead of its puts (Store: one request a put)
    writes.py        Writes: Reserve, Commit, Store; what every commit sets off (events, peers, disk, watermarks)
    disk_link.py     DiskLink: when blocks are written (commit / evict), admission, the write budget; the
                     mover's hooks (they take the lock)
    promotions.py    Promotions: disk blocks read back into slots, and the groups that wait for room
    lookups.py       Lookups: the steps of a Lookup across tiers
    hints.py         Hints: Retain/Release (policy priorities), Demote, Prefetch, Pin with a TTL
    misses.py        MissLedger: keys that left the store, when and why (miss_causes.py: a miss's cause)
    views.py         Views: ListKeys, Describe, Stats (RAM half under the lock, disk half without; asked
                     through queries.py, Engine's base: the read-only questions)

Locking: one lock (engine_lock.py) around every public method, no part has its own (the mover, event bus and
DiskStore have theirs, taken after it); O(batch) Python under it, its only I/O disk-index reads. A Commit or Store
may leave its eviction for after its reply (settle_later, settle()): the lock's next holder runs it first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.catalog import Catalog, EntryState, Namespace
from kvstore.engine.claims import CLAIMED, HELD, PENDING, ClaimTable, check_claim
from kvstore.engine.counters import Counters
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.engine_lock import EngineLock
from kvstore.engine.events import REMOVED, EventBus
from kvstore.engine.hints import Hints, parse_hint
from kvstore.engine.key_mirror import KeyIndexMirror
from kvstore.engine.leases import LeaseTable
from kvstore.engine.lookups import Lookups
from kvstore.engine.miss_causes import MissCauses
from kvstore.engine.misses import DELETED, KeyExplanation, MissLedger
from kvstore.engine.namespaces import NamespaceTable
from kvstore.engine.queries import EngineQueries
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.reservations import ReservationTable
from kvstore.engine.restarts import EngineRestarts
from kvstore.engine.results import EngineConfig, LookupResult, ReserveResult, StoreResult
from kvstore.engine.spares import MAX_PER_OWNER, SpareSlots
from kvstore.engine.views import Views
from kvstore.engine.writes import RemoteHooks, Writes
from kvstore.errors import InvalidRequestError, UnknownNamespaceError
from kvstore.fastpath.key_index import IndexTable
from kvstore.hint_vocab import HintAction
from kvstore.policies import EvictionPolicy
from kvstore.policies.admission import AdmissionPolicy
from kvstore.policies.write_budget import WriteBudget
from kvstore.tiers.disk import DiskStore
from kvstore.validation import check_count, check_sizes
from kvstore.vocab import Tier

__all__ = ["Engine", "RemoteHooks"]

_COMMITTED = int(EntryState.COMMITTED)
_PROMOTING = int(EntryState.PROMOTING)
_NONE = int(Tier.NONE)


class Engine(EngineQueries, EngineRestarts):
    """The store's metadata behind one lock: each public method validates, takes the lock, asks the parts in
    order (see the module docstring) and returns a value object from results.py; the read-only questions are
    its base's (queries.py). Thread-safe."""

    def __init__(
        self,
        config: EngineConfig,
        layout: ArenaLayout,
        generations: np.ndarray,
        allocator: SlabAllocator,
        policy: EvictionPolicy,
        *,
        disk: DiskStore | None = None,
        admission: AdmissionPolicy | None = None,
        arena_address: int = 0,
        quotas: TenantQuotas | None = None,
        namespaces: dict[int, dict[str, object]] | None = None,
        write_mode: str = "commit",
        budget: WriteBudget | None = None,
    ) -> None:
        """`namespaces`: a predecessor's namespaces by id (a restart that keeps the RAM tier: restarts.py), placed
        before the disk tier's; those that could not be taken are in `lost_namespaces`."""
        self.config = config
        self.layout = layout
        self.counters = Counters()
        self.events = EventBus()
        self._lock = EngineLock()
        self._cat = cat = Catalog()
        self._names = NamespaceTable(cat, config)
        self.misses = MissLedger(config.miss_ledger_keys)
        self.claims = ClaimTable(config.claim_keys)  # schedulers' claims on keys they compute now (claims.py)
        self._causes = MissCauses(cat, self.misses, self.counters, policy.name or type(policy).__name__)
        self._ram = RamSpace(config, cat, layout, generations, allocator, policy, quotas, self.counters, self.events,
                             self.misses)
        self._leases = LeaseTable(cat, config.lease_ttl_s, self._ram.free, self.counters)
        self._reservations = ReservationTable(cat, config, self._free_unwritten, self.counters)
        self._disk = DiskLink(disk, admission, cat=cat, ram=self._ram, leases=self._leases, counters=self.counters,
                              events=self.events, lock=self._lock, arena_address=arena_address,
                              queue_blocks=config.write_queue_blocks, misses=self.misses, write_mode=write_mode,
                              budget=budget)
        self._lookups = Lookups(cat, self._ram, self._leases, self._disk, self.counters)
        self._hints = Hints(config, cat, self._ram, self._disk, self._lookups, self.counters, quotas)
        self._views = Views(config, cat, self._ram, self._leases, self._reservations, disk, self.counters)
        self._spares = SpareSlots(config, self._ram)
        self._writes = Writes(config, cat, self._ram, self._reservations, self._spares, self._disk, self._hints,
                              self.events, self.counters, self._lock.defer)
        self.journal = None  # the RAM journal's writer, once attached (restarts.py)
        self.lost_namespaces = self._names.adopt(namespaces) if namespaces else set()
        if disk is not None:  # known from before a restart; the next registration describes them
            self._names.recover(disk.namespaces())

    def _free_unwritten(self, eid: int) -> None:
        """A reservation's slot freed without a Commit (abort, expiry): hints waiting for it go too."""
        self._hints.forget(eid)
        self._ram.free(eid)

    def attach_remote(self, remote: RemoteHooks | None) -> None:
        """The peer tier's hooks: `fill` on Lookup (fetch misses from owners), `committed` on Commit (push)."""
        self._writes.remote = remote  # None until the daemon attaches the peer tier (etcd configured)

    def start(self) -> None:
        """Start the background I/O threads (the daemon calls this once its RPC server is up)."""
        self._disk.start()

    def stop(self) -> None:
        """Finish queued disk writes and promotions, then stop the I/O threads. Under disk_write = evict, RAM's
        blocks that have no disk copy are written first (a clean stop loses nothing the disk has room for)."""
        with self._lock:
            self._disk.flush()
        self._disk.stop()

    # -- namespaces -------------------------------------------------------------------------------------
    def register_namespace(self, name: str, model: str = "", layout_digest: str = "", tenant: str = "",
                           disk_codec: str = "", tokens_per_block: int | None = None) -> bool:
        """True when created; False when it existed with the same description (ConflictError otherwise).

        `tokens_per_block` (None: unknown) makes lookups and hits countable in tokens. Once set it belongs to
        the description: another value, or setting it on a namespace registered without it, is a conflict
        (token counters derived from block counters would silently change meaning). Leaving it unset when
        registering again is not a conflict: a tool that does not know it may re-register."""
        codec = self._names.check(name, model, layout_digest, tenant, disk_codec, tokens_per_block)
        with self._lock:
            return self._names.register(name, model, layout_digest, tenant, codec, tokens_per_block or 0,
                                        self._drop_ram_copies)

    def assign_recovered_tenants(self, owners: dict[str, str]) -> None:
        """Owners of namespaces recovered from the disk tier (the daemon's owners file), before any RPC: blocks
        promoted or fetched for them land in their tenant's arena file (isolate_tenants) and count toward it."""
        with self._lock:
            self._names.assign_recovered_tenants(owners)

    def tokens_per_block(self, ns_name: str) -> int:
        """The namespace's tokens per block (0: unknown); UnknownNamespaceError if it is not registered."""
        with self._lock:
            return self._names.get(ns_name).tokens_per_block

    def _drop_ram_copies(self, ns: Namespace) -> None:
        """Forget a namespace's RAM entries (its disk copies stay): used when its tenant, and so the memory file
        its slots must live in, changes. Reserved entries are unindexed; their commit leaves an invisible entry
        that eviction reclaims."""
        for eid in list(ns.index.values()):
            if not self._delete_one(eid):
                self._cat.unindex(eid)

    # -- writes -----------------------------------------------------------------------------------------
    def reserve(self, ns_name: str, keys: Sequence[bytes], sizes: Sequence[int]) -> ReserveResult:
        self._check_keys(keys, unique=True)
        check_sizes(sizes, len(keys), self.config.max_block_bytes)
        return self._disk.with_room(lambda: self._writes.reserve(self._names.get(ns_name), keys, sizes),
                                    self.config.promote_timeout_s)

    def commit(self, reservation_id: int, checksums: Sequence[int] = (), settle_later: bool = False) -> int:
        """`settle_later`: the watermark eviction it sets off waits for `settle` or the next call (engine_lock.py)."""
        with self._lock:
            return self._writes.commit(reservation_id, checksums, settle_later)

    def spare(self, owner: int, size: int, count: int, tenant: str = "") -> tuple[int, list[int]]:
        """A connection's spare slots replaced by `count` for `size`-byte blocks, or none (spares.py)."""
        check_sizes([size], 1, self.config.max_block_bytes)
        check_count("spare slots", count, MAX_PER_OWNER)
        with self._lock:
            return self._spares.replace(owner, size, count, tenant)

    def store(self, owner: int, ns_name: str, keys: Sequence[bytes], sizes: Sequence[int],
              offsets: Sequence[int], settle_later: bool = False) -> StoreResult:
        """Reserve + Commit in one step of blocks copied into the caller's spare slots (writes.py); see commit."""
        self._check_keys(keys, unique=True)
        check_sizes(sizes, len(keys), self.config.max_block_bytes)
        with self._lock:
            return self._writes.store(owner, self._names.get(ns_name), keys, sizes, offsets, settle_later)

    def settle(self) -> None:
        """Run now what a call left for after its reply (a front end calls this once the reply is sent)."""
        self._lock.settle()

    def drop_spares(self, owner: int) -> int:
        """`owner`'s connection closed: its spare slots go to the quarantine (freed after quarantine_s)."""
        with self._lock:
            return self._spares.drop(owner, time.monotonic())

    def spare_status(self) -> dict[str, int]:
        return self._spares.status()  # two ints, read whole under the GIL: no lock needed for the metrics

    def abort(self, reservation_id: int) -> int:
        with self._lock:
            return self._reservations.abort(reservation_id)

    # -- reads ------------------------------------------------------------------------------------------
    def lookup(self, ns_name: str, keys: Sequence[bytes], prefix: bool = False,
               lease: bool = True, local_only: bool = False, summary: bool = False) -> LookupResult:
        """Present keys in any tier (lookups.py). `summary` (only without lease): the caller wants num_prefix,
        present and tiers, not where the hits are (a scheduler counting a prefix): the hit columns come back
        empty and are never built."""
        self._check_keys(keys)
        summary = summary and not lease
        at_peers = None
        remote = self._writes.remote
        if remote is not None and not local_only:  # peer tier first (no lock held)
            if lease:
                filled = remote.fill(ns_name, keys)  # fetch local misses (joins prefetches in flight)
                res = self._lookup(ns_name, keys, prefix, lease, summary, at_peers)
                gone = [keys[i] for i, p in enumerate(res.present) if not p and keys[i] in filled.here]
                if gone:  # let go here (its owner has it: peer/guests.py) after fill looked: fetch it, once
                    remote.fill(ns_name, gone)
                    if res.lease_id:
                        self.release([res.lease_id])
                    res = self._lookup(ns_name, keys, prefix, lease, summary, at_peers)
                remote.loaded(ns_name, keys)     # the blocks it fetched are leased now: guests from here on
                return res
            at_peers = remote.prefetch(ns_name, keys, prefix)  # probe; fetch in the background
        return self._lookup(ns_name, keys, prefix, lease, summary, at_peers)

    def _lookup(self, ns_name: str, keys: Sequence[bytes], prefix: bool, lease: bool, summary: bool,
                at_peers: list[bool] | None) -> LookupResult:
        with self._lock:
            ns = self._names.get(ns_name)
            eids, tiers = self._lookups.locate(ns, keys, at_peers)
            first = self._lookups.ram_prefix(tiers)
            if first == len(keys) or (prefix and tiers[first] == _NONE):
                # the common case: the hits are the first `first` keys, all in RAM
                return self._counted(ns, keys, prefix,
                                     self._lookups.ram_hits(ns, keys, prefix, lease, eids, tiers, first, summary))
            pending = self._lookups.begin(ns, keys, prefix, lease, eids, tiers, summary)
            if isinstance(pending, LookupResult):
                return self._counted(ns, keys, prefix, pending)
        deadline = time.monotonic() + self.config.promote_timeout_s
        for p in pending.promotions.values():
            p.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return self._counted(ns, keys, prefix, self._lookups.finish(ns, keys, prefix, pending))

    def probe(self, ns_name: str, prior_ids: np.ndarray, prior_serials: np.ndarray,
              tail: Sequence[bytes], read: bool = False) -> LookupResult:
        """A prefix probe (no lease, counts only) whose leading keys the caller found in the shared key index
        (key_mirror.py): their entry ids and serials, then the keys after them. The answer and its effects are
        a `lookup(those keys + tail, prefix=True, lease=False, summary=True)`'s: the leading entries are
        checked under the lock (Lookups.prior_hits), the tail is looked up as usual when all of them hold. One
        difference: when a leading entry no longer holds (evicted since the client read the index), the prefix
        ends there without a miss cause counted (its key is not in the request). `read` (no tail): the caller
        copied the blocks out itself (a get answered from the index), so their bytes count as read."""
        self._check_entry_ids(prior_ids, prior_serials, len(tail))
        if tail:
            self._check_keys(tail)
        remote = self._writes.remote
        with self._lock:
            k, done = self._lookups.probe_head(self._names.get(ns_name), prior_ids, prior_serials, len(tail),
                                               read and not tail)
            keys = ([self._cat.keys[e] for e in prior_ids.tolist() if self._cat.keys[e] is not None]
                    if read and not tail and remote is not None else None)
        if keys and remote is not None:
            remote.loaded(ns_name, keys)
        if done is not None:
            return done
        return Lookups.after_head(k, self.lookup(ns_name, tail, prefix=True, lease=False, summary=True))

    def lookup_entries(self, ns_name: str, ids: np.ndarray, serials: np.ndarray, prefix: bool = False,
                       lease: bool = True, summary: bool = False) -> LookupResult | None:
        """A Lookup whose every key the caller found in the shared key index (entry ids and serials): the
        answer, effects and lease of `lookup(those keys, ...)` when every entry still holds; None, with nothing
        done or counted, when one does not (evicted since): the caller then sends the Lookup with its keys."""
        self._check_entry_ids(ids, serials, 0)
        remote = self._writes.remote
        with self._lock:
            res = self._lookups.entries(self._names.get(ns_name), ids, serials, prefix, lease, summary and not lease)
            keys = [self._cat.keys[e] for e in ids.tolist()] if res is not None and lease and remote else None
        if keys and remote is not None:
            remote.loaded(ns_name, keys)
        return res

    def _check_entry_ids(self, ids: np.ndarray, serials: np.ndarray, more_keys: int) -> None:
        if len(ids) != len(serials):
            raise InvalidRequestError(f"{len(ids)} entry ids with {len(serials)} serials")
        check_count("keys", len(ids) + more_keys, self.config.max_batch_keys)

    def attach_key_index(self, entries: int, incarnation: int, per_tenant: bool,
                         authoritative: bool = False, adopted: dict[str, IndexTable] | None = None) -> KeyIndexMirror:
        """Start mirroring RAM entries into shared key indexes (key_mirror.py); before any block is stored.
        `authoritative`: RAM is the only tier (no disk, no peers), so a key absent from a table is absent.
        `adopted`: a predecessor's tables (a hand-over: they hold its entries, which `adopt` keeps)."""
        with self._lock:
            mirror = KeyIndexMirror(self._cat, entries, incarnation, per_tenant, authoritative, adopted)
            self._cat.mirror = mirror
            return mirror

    def _counted(self, ns: Namespace, keys: Sequence[bytes], prefix: bool, res: LookupResult) -> LookupResult:
        """A prefix Lookup that stopped short counts the cause of its first miss (miss_causes.py)."""
        if prefix and res.num_prefix < len(keys):
            self._causes.count(ns, keys[res.num_prefix], res.tiers[res.num_prefix])
        return res

    def explain(self, ns_name: str, keys: Sequence[bytes]) -> list[KeyExplanation]:
        """Per key, in order: the tier it lives in now, or why it is absent (misses.py). Counts nothing."""
        self._check_keys(keys)
        with self._lock:
            ns = self._names.get(ns_name)
            _, tiers = self._lookups.locate(ns, keys)
            return self._causes.explain(ns, keys, tiers.tolist())

    def release(self, lease_ids: Sequence[int]) -> int:
        with self._lock:
            return self._leases.release(lease_ids)

    def exists(self, ns_name: str, keys: Sequence[bytes], cluster: bool = False) -> list[bool]:
        """Present in RAM (or being promoted) or on disk; no lease, no promotion. `cluster`: keys missing here
        are asked of the peer tier (their owners; metadata only, no lock held), and count as present there."""
        self._check_keys(keys)
        with self._lock:
            ns = self._names.get(ns_name)
            _, tiers = self._lookups.locate(ns, keys)
            present: list[bool] = (tiers != _NONE).tolist()
        remote = self._writes.remote
        if cluster and remote is not None and not all(present):
            missing = [k for k, p in zip(keys, present) if not p]
            elsewhere = dict(zip(missing, remote.held_elsewhere(ns_name, missing)))
            present = [p or elsewhere.get(k, False) for k, p in zip(keys, present)]
        return present

    def claim(self, ns_name: str, keys: Sequence[bytes], claimant: bytes, ttl_ms: int,
              local_only: bool = False) -> list[int]:
        """Per key HELD, PENDING (another claimant's live claim: wait for its save) or CLAIMED (the caller's to
        compute), claims.py. Keys missing here are asked of their owners first (the peer tier records the
        claim there too) unless `local_only` (a peer's own Claim: it must not fan out again). No lock held
        while peers answer."""
        check_claim(claimant, ttl_ms)
        try:
            present = self.exists(ns_name, keys)  # checks the keys and the namespace before anything is recorded
        except UnknownNamespaceError:
            if not local_only:
                raise
            present = [False] * len(keys)  # an owner that has not met the namespace yet holds its claims all the same
        known: list[int | None] = [HELD if p else None for p in present]
        remote = self._writes.remote
        if remote is not None and not local_only and not all(present):
            missing = [k for k, p in zip(keys, present) if not p]
            there = remote.claim(ns_name, missing, claimant, ttl_ms)
            known = [x if x is not None else there.get(k) for k, x in zip(keys, known)]
        states = self.claims.claim(ns_name, keys, known, claimant, ttl_ms)
        with self._lock:
            c = self.counters
            c.claim_held_keys += states.count(HELD)
            c.claim_pending_keys += states.count(PENDING)
            c.claim_claimed_keys += states.count(CLAIMED)
            c.claim_refused_keys = self.claims.refused
        return states

    def tiers(self, ns_name: str, keys: Sequence[bytes]) -> list[int]:
        """Per key: the nearest tier holding it here (Tier.RAM; Tier.DISK also while it is being promoted;
        Tier.NONE). Metadata only: no lease, no promotion, no counter, no eviction order touched (a router's
        prefix score asks it of every node: kvstore/peer/scores.py)."""
        self._check_keys(keys)
        with self._lock:
            _, tiers = self._lookups.locate(self._names.get(ns_name), keys)
            return [int(t) for t in tiers.tolist()]

    # -- removal and pins (a leased block is DOOMED, not freed: its slot goes at the last release) -------
    def delete(self, ns_name: str, keys: Sequence[bytes]) -> int:
        """Remove keys from every tier; returns how many were present anywhere."""
        self._check_keys(keys)
        with self._lock:
            ns = self._names.get(ns_name)
            in_ram = [self._delete_one(ns.index.get(k)) for k in keys]
            on_disk = self._disk.contains_many(ns.name, keys)
            self.misses.left(ns.id, [k for k, r, d in zip(keys, in_ram, on_disk) if r or d], DELETED)
        if any(on_disk):
            self._disk.delete(ns.name, [k for k, d in zip(keys, on_disk) if d])  # index I/O: outside the lock
        return sum(1 for r, d in zip(in_ram, on_disk) if r or d)

    def _delete_one(self, eid: int | None) -> int:
        """Remove one RAM entry (under the lock); 1 when there was a block to remove."""
        if eid is None:
            return 0
        state = self._cat.state[eid]
        if state == _COMMITTED:
            self._ram.delete(eid)
            return 1
        if state == _PROMOTING:
            self._disk.cancel_promotion(eid)  # the promoter frees the slot when its read returns
            return 1
        return 0

    def clear_namespace(self, ns_name: str) -> int:
        """Delete every block of a namespace in every tier; returns how many distinct keys went."""
        with self._lock:
            ns = self._names.get(ns_name)
            ram_keys = {k for k, e in list(ns.index.items()) if self._delete_one(e)}
            self.misses.cleared(ns.id)
            # the clear as one event (after each RAM block's own): the vLLM-format publisher's AllBlocksCleared
            self.events.publish(REMOVED, ns.name, [], Tier.RAM, whole_namespace=True)
        store = self._disk.store
        if store is None:
            return len(ram_keys)
        self.events.publish(REMOVED, ns.name, [], Tier.DISK, whole_namespace=True)
        both = sum(1 for n in store.contains_many(ns.name, list(ram_keys)) if n) if ram_keys else 0
        return len(ram_keys) + store.clear_namespace(ns.name) - both

    def pin(self, ns_name: str, keys: Sequence[bytes], delta: int) -> int:
        """delta=+1 pins, -1 unpins; returns how many keys changed (unpin of an unpinned key changes none)."""
        self._check_keys(keys)
        with self._lock:
            return self._ram.pin(self._names.get(ns_name), keys, delta)

    def hint(self, ns_name: str, keys: Sequence[bytes], action: HintAction | str, ttl_s: float = 0.0) -> list[str]:
        """An agent's hint on `keys`: one HintOutcome value per key (hints.py); InvalidRequestError for a bad
        action or ttl. Prefetch runs a probe Lookup first (no lease: promotions start, as a scheduler's do)."""
        act, ttl = parse_hint(action, ttl_s)
        self._check_keys(keys)
        probed = self.lookup(ns_name, keys, lease=False, summary=True).tiers if act is HintAction.PREFETCH else None
        with self._lock:
            out = self._hints.apply(self._names.get(ns_name), keys, act, ttl, time.monotonic(), probed)
            gone = self._disk.take_let_go()
        self._disk.delete_let_go(gone)  # a Release's disk copies (index I/O: outside the lock)
        return out

    def let_go(self, ns_name: str, keys: Sequence[bytes], drop: bool = False) -> int:
        """RAM copies this node does not own (the peer tier's): first to go, or dropped now (hints.py let_go);
        unknown keys and namespaces are ignored. The entries marked or dropped."""
        with self._lock:
            ns = self._cat.by_name.get(ns_name)
            return 0 if ns is None else self._hints.let_go(ns, keys, drop)

    # -- time -------------------------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> None:
        """Expire leases and reservations, free quarantined slots, retry a degraded disk. Called periodically."""
        now = time.monotonic() if now is None else now
        self._disk.probe_if_due(now, self.config.probe_interval_s)  # outside the lock: it does I/O
        with self._lock:
            self._ram.apply_touches()
            self._leases.expire(now)
            self._reservations.expire(now)
            self._spares.expire(now)
            self._hints.expire(now)

    def note_checksums(self, lease_id: int, offsets: Sequence[int], checksums: Sequence[int]) -> int:
        """Remember the xxh3 a reader computed of leased blocks committed without one (leases.py): a committed
        block's bytes never change, so a peer's send hashes it once, not at every fetch; how many were set."""
        with self._lock:
            return self._leases.note_checksums(lease_id, offsets, checksums)

    def note_checksum_failure(self) -> None:
        """Bytes that failed their checksum on the way in (counted; the block was not stored)."""
        with self._lock:
            self.counters.checksum_failures += 1
