"""The engine: reservations, commits, leases, eviction, and the movement between the RAM and disk tiers.

Metadata only; clients (and the disk I/O threads) move the bytes. Primitives and their contracts (statuses are
exceptions from kvstore.errors; see each method):

- reserve(ns, keys, sizes): slots for every key not present yet (in RAM or on disk), all or nothing
  (StoreFullError). Reserved slots are invisible until commit and never evicted.
- commit(rid, checksums) / abort(rid): end a reservation (ReservationClosedError if it already ended,
  UnknownReservationError if it never existed). A reservation that outlives its TTL is expired: its slots go
  to a quarantine for `quarantine_s` before reuse, so a slow writer cannot scribble over a new owner's block.
  A commit queues admitted blocks for the disk writer (write-behind, see tiering.py).
- lookup(ns, keys, prefix, lease) (tiering.py): present keys in any tier; RAM hits are leased, disk hits are
  promoted into the arena (a get waits for them). A leased slot is never evicted or reused. A lease that
  outlives its TTL is dropped; a reader that copied past that point sees the slot's generation changed
  (bumped on every free) and treats its copy as a miss.
- release(lease_ids), exists, delete (every tier; a leased block is hidden at once, freed at its last
  release), pin/unpin (pinned blocks are never evicted), clear_namespace, list_keys/describe/stats
  (inspection.py), sweep(now).

Eviction: a reserve that finds no slot asks the policy for victims among committed, unleased, unpinned
entries until the allocation succeeds. After a commit that leaves allocated bytes above the high watermark,
victims are evicted down to the low watermark. Evicting a block that has a disk copy only drops the RAM copy.
With tenant quotas (quotas.py, tenancy.py) victims come from over-quota tenants first, then, for an
allocation, from the requesting tenant's own blocks; no other tenant is evicted below its quota.

Locking: one lock, `self._lock`, around every public method; the policy, allocator and catalog have none.
Every method does O(batch) Python work under it; the only I/O under it is disk-index reads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.catalog import ON_DISK, Catalog, EntryState, Namespace
from kvstore.engine.counters import Counters
from kvstore.engine.events import MOVED, REMOVED, STORED, EventBus
from kvstore.engine.generations import GenerationIndex
from kvstore.engine.results import (
    ALREADY_PRESENT,
    IN_FLIGHT,
    RESERVED,
    EngineConfig,
    ReserveResult,
)
from kvstore.engine.movement import Mover, Promotion
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.tenancy import TenancyMixin
from kvstore.engine.management import ManagementMixin
from kvstore.engine.read_buffer import ReadBuffer
from kvstore.engine.inspection import InspectionMixin
from kvstore.engine.tiering import TIER_DISK, TIER_RAM, TieringMixin
from kvstore.engine.ttl import TtlTable
from kvstore.errors import (
    ConflictError,
    InvalidRequestError,
    ReservationClosedError,
    StoreFullError,
    UnknownNamespaceError,
    UnknownReservationError,
)
from kvstore.policies import EvictionPolicy
from kvstore.policies.admission import AdmissionPolicy, AlwaysAdmit
from kvstore.tiers.disk import DISK_CODECS, DiskStore
from kvstore.validation import check_keys, check_label, check_namespace_name, check_sizes, check_tokens_per_block

__all__ = ["Engine"]

# Plain ints: comparing a numpy scalar with an IntEnum member costs ~13 us, with an int ~0.2 us.
_COMMITTED = int(EntryState.COMMITTED)
_RESERVED = int(EntryState.RESERVED)
_DOOMED = int(EntryState.DOOMED)
_QUARANTINED = int(EntryState.QUARANTINED)
_RECENT_CLOSED = 8192
_ONE = np.int32(1)  # the leases column's dtype: np.subtract.at stays on its fast path (~1 us for 280 ids, not ~16)


class RemoteHooks(Protocol):
    """What the engine asks of the peer tier (kvstore.peer.PeerCluster); both are called with keys only."""

    def fill(self, namespace: str, keys: Sequence[bytes]) -> int: ...    # before a leased Lookup, no lock held
    def prefetch(self, namespace: str, keys: Sequence[bytes], prefix: bool) -> list[bool]: ...  # one without lease
    def committed(self, reservation_id: int, namespace: str, keys: Sequence[bytes]) -> None: ...  # under the lock


class Engine(TieringMixin, InspectionMixin, TenancyMixin, ManagementMixin):
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
    ) -> None:
        self.config = config
        self.layout = layout
        self._gens = generations
        self._gen_index = GenerationIndex(layout)
        self._alloc = allocator
        self._policy = policy
        self._cat = Catalog()
        self._leases: TtlTable[np.ndarray] = TtlTable(config.lease_ttl_s)
        self._reservations: TtlTable[tuple[Namespace, list[int]]] = TtlTable(config.reservation_ttl_s)
        self._closed: OrderedDict[int, str] = OrderedDict()  # recently ended reservations -> how
        self._quarantine: deque[tuple[float, int]] = deque()
        self._touches = ReadBuffer(policy)
        self.counters = Counters()
        self.events = EventBus()
        self._lock = threading.Lock()
        # disk tier (optional): the store, its admission policy, the I/O threads, promotions in flight
        self._disk = disk
        self._admission = admission or AlwaysAdmit()
        self._arena_address = arena_address
        self._promotions: dict[int, Promotion] = {}
        self._mover = Mover(disk, self, queue_blocks=config.write_queue_blocks) if disk is not None else None
        self._next_probe = 0.0
        self._remote: RemoteHooks | None = None  # the peer tier, attached by the daemon when etcd is configured
        self._quotas = quotas if quotas is not None and quotas.enabled else None  # quotas.py: eviction floors
        if disk is not None:
            for name in disk.namespaces():  # known from before a restart; the next registration describes them
                self._cat.add_namespace(name, "", "", "", recovered=True)

    def attach_remote(self, remote: RemoteHooks | None) -> None:
        """The peer tier's hooks: `fill` on Lookup (fetch misses from owners), `committed` on Commit (push)."""
        self._remote = remote

    def start(self) -> None:
        """Start the background I/O threads (the daemon calls this once its RPC server is up)."""
        if self._mover is not None:
            self._mover.start()

    def stop(self) -> None:
        """Finish queued disk writes and promotions, then stop the I/O threads."""
        if self._mover is not None:
            self._mover.stop()

    # -- namespaces -------------------------------------------------------------------------------------
    def register_namespace(self, name: str, model: str = "", layout_digest: str = "", tenant: str = "",
                           disk_codec: str = "", tokens_per_block: int | None = None) -> bool:
        """True when created; False when it existed with the same description (ConflictError otherwise).

        `tokens_per_block` (None: unknown) makes lookups and hits countable in tokens. Once set it belongs to
        the description: another value, or setting it on a namespace registered without it, is a conflict
        (token counters derived from block counters would silently change meaning). Leaving it unset when
        registering again is not a conflict: a tool that does not know it may re-register.
        """
        check_namespace_name(name)
        check_tokens_per_block(tokens_per_block)
        for what, value in (("model", model), ("layout_digest", layout_digest), ("tenant", tenant)):
            check_label(what, value)
        if disk_codec not in DISK_CODECS:
            raise InvalidRequestError(f"disk_codec={disk_codec!r}: use one of {', '.join(DISK_CODECS[1:])} or ''")
        codec = disk_codec or self.config.disk_codec
        tpb = tokens_per_block or 0
        with self._lock:
            ns = self._cat.by_name.get(name)
            if ns is None:
                ns = self._cat.add_namespace(name, model, layout_digest, tenant, codec)
                ns.tokens_per_block = tpb
                return True
            if ns.recovered:  # came back from the disk tier after a restart: adopt the description
                if self.config.isolate_tenants and tenant != ns.tenant:
                    self._drop_ram_copies(ns)  # they sit in the old tenant's memory file, not the new one's
                ns.model, ns.layout_digest, ns.tenant, ns.disk_codec = model, layout_digest, tenant, codec
                ns.tokens_per_block = tpb
                ns.recovered = False
                return False
            if (ns.model, ns.layout_digest, ns.tenant) != (model, layout_digest, tenant):
                raise ConflictError(
                    f"namespace {name!r} is registered as model={ns.model!r} layout={ns.layout_digest!r} "
                    f"tenant={ns.tenant!r}: a different layout needs a different namespace name"
                )
            if tpb and tpb != ns.tokens_per_block:
                was = f"tokens_per_block={ns.tokens_per_block}" if ns.tokens_per_block else "no tokens_per_block"
                raise ConflictError(
                    f"namespace {name!r} is registered with {was}, not {tpb}: a different block size needs a "
                    "different namespace name (register it once, with its tokens_per_block, before any other tool)"
                )
            return False

    def assign_recovered_tenants(self, owners: dict[str, str]) -> None:
        """Owners of namespaces recovered from the disk tier (the daemon's owners file), before any RPC: blocks
        promoted or fetched for them land in their tenant's arena file (isolate_tenants) and count toward it."""
        with self._lock:
            for ns in self._cat.namespaces:
                if ns.recovered and ns.name in owners:
                    ns.tenant = owners[ns.name]

    def _drop_ram_copies(self, ns: Namespace) -> None:
        """Forget a namespace's RAM entries (its disk copies stay): used when its tenant, and so the memory file
        its slots must live in, changes. Reserved entries are unindexed; their commit leaves an invisible entry
        that eviction reclaims."""
        for key, eid in list(ns.index.items()):
            if not self._delete_one(eid):
                self._cat.unindex(eid)

    def tokens_per_block(self, ns_name: str) -> int:
        """The namespace's tokens per block (0: unknown); UnknownNamespaceError if it is not registered."""
        with self._lock:
            return self._namespace(ns_name).tokens_per_block

    def _namespace(self, name: str) -> Namespace:
        ns = self._cat.by_name.get(name)
        if ns is None:
            check_namespace_name(name)
            raise UnknownNamespaceError(f"unknown namespace {name!r}: register it first (RegisterNamespace)")
        return ns

    def _check_keys(self, keys: Sequence[bytes], unique: bool = False) -> None:
        cfg = self.config
        check_keys(keys, cfg.max_batch_keys, max_key_bytes=cfg.max_key_bytes, unique=unique)

    # -- writes -----------------------------------------------------------------------------------------
    def reserve(self, ns_name: str, keys: Sequence[bytes], sizes: Sequence[int]) -> ReserveResult:
        self._check_keys(keys, unique=True)
        check_sizes(sizes, len(keys), self.config.max_block_bytes)
        with self._lock:
            ns = self._namespace(ns_name)
            cat, index = self._cat, ns.index
            self.counters.reserve_calls += 1
            outcomes = [RESERVED] * len(keys)
            offsets = [0] * len(keys)
            todo: list[int] = []
            keep: set[int] = set()  # ALREADY_PRESENT entries: evicting them here would make the outcome a lie
            known = list(map(index.get, keys))
            if known.count(None) == len(keys):  # the common case: every key is new
                todo = list(range(len(keys)))
            else:
                for i, eid in enumerate(known):
                    if eid is None:
                        todo.append(i)
                    elif cat.state[eid] == _COMMITTED:
                        outcomes[i] = ALREADY_PRESENT
                        keep.add(eid)
                    else:
                        outcomes[i] = IN_FLIGHT
            if todo and self._disk is not None:
                on_disk = self._disk.contains_many(ns.name, [keys[i] for i in todo])
                for i, length in zip(list(todo), on_disk):
                    if length:
                        outcomes[i] = ALREADY_PRESENT
                        todo.remove(i)
            if not todo:
                return ReserveResult(0, outcomes, offsets, 0)
            for i in todo:
                off = self._allocate(sizes[i], keep, ns.tenant)
                if off is None:
                    for j in todo:
                        if offsets[j]:
                            self._alloc.free(offsets[j])
                    self.counters.store_full += 1
                    raise StoreFullError(self._full_message(sum(sizes[j] for j in todo)))
                offsets[i] = off
            if len(todo) == len(keys):
                eids = cat.add_many(ns, keys, offsets, sizes)
            else:  # the keys to add, in order
                eids = cat.add_many(ns, [keys[i] for i in todo], [offsets[i] for i in todo], [sizes[i] for i in todo])
            rid = self._reservations.add((ns, eids))
            self.counters.reserved_blocks += len(eids)
            return ReserveResult(rid, outcomes, offsets, int(self.config.reservation_ttl_s * 1000))

    def _full_message(self, wanted: int) -> str:
        alloc = self._alloc
        return (
            f"store full: cannot place {wanted} bytes; {alloc.allocated_bytes} of {alloc.capacity} arena bytes are "
            f"allocated, {alloc.free_slabs} of {alloc.n_slabs} slabs ({alloc.slab_bytes} bytes each) free, and "
            "nothing else is evictable (leased, pinned or reserved). Release leases, unpin blocks, use fewer "
            "distinct block sizes per batch (each size class needs a slab), or give the daemon a larger arena_bytes"
            + ("; tenant_ram_quota protects other tenants' blocks up to their quotas" if self._quotas else "")
        )

    def _allocate(self, size: int, keep: set[int], tenant: str | None = None) -> int | None:
        """A slot of `size`, evicting as needed; `tenant` is who asks (quotas.py decides whose blocks may go).

        With isolate_tenants the slot comes from a slab bound to the tenant's own memory file (arena/backing.py),
        so only that tenant's processes can map it; evicting another tenant's blocks helps only once one of its
        slabs is empty and can move."""
        domain = (tenant or "") if self.config.isolate_tenants else ""
        off = self._alloc.allocate(size, domain)
        if off is not None:
            return off
        eligible = (lambda eid: eid not in keep and self._evictable(eid)) if keep else self._evictable
        while off is None:
            victim = (self._choose_victim(eligible) if self._quotas is None
                      else self._choose_quota_victim(eligible, tenant))
            if victim is None:
                return None
            self._evict(victim)
            off = self._alloc.allocate(size, domain)
        return off

    def _choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        self._touches.apply()
        return self._policy.choose_victim(eligible)

    def _evictable(self, eid: int) -> bool:
        cat = self._cat
        return cat.state[eid] == _COMMITTED and cat.leases[eid] == 0 and cat.pins[eid] == 0

    def _evict(self, eid: int) -> None:
        """Drop a committed entry the policy has already forgotten."""
        size = int(self._cat.size[eid])
        if self.events.subscribers:
            ns, key = self._cat.namespace_of(eid).name, self._cat.keys[eid]
            if self._cat.flags[eid] & ON_DISK:
                self.events.publish(MOVED, ns, [key], TIER_RAM, TIER_DISK)
            else:
                self.events.publish(REMOVED, ns, [key], TIER_RAM)
        if self._cat.flags[eid] & ON_DISK:
            self.counters.evicted_to_disk += 1  # the disk tier keeps it: only the RAM copy goes
        self._forget_committed(eid)
        self._free(eid)
        self.counters.evictions += 1
        self.counters.evicted_bytes += size

    def _forget_committed(self, eid: int) -> None:
        cat = self._cat
        ns = cat.namespace_of(eid)
        ns.blocks -= 1
        ns.bytes -= int(cat.size[eid])
        cat.unindex(eid)

    def _free(self, eid: int) -> None:
        """Return an entry's slot. The generation bump is what makes any outstanding copy of it a miss."""
        off = int(self._cat.offset[eid])
        self._gens[self._gen_index.of(off)] += 1
        self._alloc.free(off)
        self._cat.drop(eid)

    def commit(self, reservation_id: int, checksums: Sequence[int] = ()) -> int:
        with self._lock:
            payload = self._reservations.get(reservation_id)
            if payload is None:
                self._raise_closed(reservation_id)
            ns, eids = payload
            if checksums and len(checksums) != len(eids):
                raise InvalidRequestError(
                    f"{len(checksums)} checksums for a reservation of {len(eids)} blocks: send none or one each"
                )
            self._reservations.pop(reservation_id)
            self._close(reservation_id, "committed")
            cat, policy, keys = self._cat, self._policy, self._cat.keys
            self._touches.apply()  # the policy must see accesses and inserts in their real order
            size = cat.mark_committed(eids, checksums)
            ns.blocks += len(eids)
            ns.bytes += size
            self.counters.committed_bytes += size
            on_insert, ns_id = policy.on_insert, ns.id
            for eid in eids:
                on_insert(eid, hash(keys[eid]) ^ ns_id)
            ns.puts += len(eids)
            self.counters.committed_blocks += len(eids)
            if self.events.subscribers:
                self.events.publish(STORED, ns.name, [cat.keys[e] for e in eids], TIER_RAM)
            if self._remote is not None:  # queues pushes to owners; never blocks
                self._remote.committed(reservation_id, ns.name, [cat.keys[e] for e in eids])
            if self._disk is not None:
                ids = np.array(eids, dtype=np.int64)
                cat.seen[ids] = 1
                if self._admission.admits(1):
                    self._queue_writes(ids)
            self._enforce_watermarks()
            return len(eids)

    def _enforce_watermarks(self) -> None:
        alloc, cfg = self._alloc, self.config
        if alloc.allocated_bytes <= cfg.high_watermark * alloc.capacity:
            return
        target = cfg.low_watermark * alloc.capacity
        while alloc.allocated_bytes > target:
            victim = (self._choose_victim(self._evictable) if self._quotas is None
                      else self._choose_quota_victim(self._evictable, None, own_pass=False))
            if victim is None:
                return
            self._evict(victim)

    def abort(self, reservation_id: int) -> int:
        with self._lock:
            payload = self._reservations.pop(reservation_id)
            if payload is None:
                self._raise_closed(reservation_id)
            self._close(reservation_id, "aborted")
            _, eids = payload
            for eid in eids:
                self._cat.unindex(eid)
                self._free(eid)
            self.counters.aborted_blocks += len(eids)
            return len(eids)

    def _close(self, reservation_id: int, how: str) -> None:
        self._closed[reservation_id] = how
        if len(self._closed) > _RECENT_CLOSED:
            self._closed.popitem(last=False)

    def _raise_closed(self, reservation_id: int) -> None:
        how = self._closed.get(reservation_id)
        if how is None:
            raise UnknownReservationError(
                f"reservation {reservation_id} is unknown to this daemon (never issued, or issued before a restart)"
            )
        hint = " (reservation_ttl_s is %gs; commit sooner or raise it)" % self.config.reservation_ttl_s
        raise ReservationClosedError(
            f"reservation {reservation_id} was already {how}" + (hint if how == "expired" else "")
        )

    # -- reads (lookup lives in tiering.py) ------------------------------------------------------------
    def release(self, lease_ids: Sequence[int]) -> int:
        released = 0
        with self._lock:
            for lid in lease_ids:
                ids = self._leases.pop(lid)
                if ids is not None:
                    self._unlease(ids)
                    released += 1
        return released

    def _unlease(self, ids: np.ndarray) -> None:
        cat = self._cat
        np.subtract.at(cat.leases, ids, _ONE)
        for eid in ids[cat.state[ids] == _DOOMED].tolist():
            if cat.leases[eid] == 0 and cat.state[eid] == _DOOMED:
                self._free(eid)

    def exists(self, ns_name: str, keys: Sequence[bytes]) -> list[bool]:
        """Present in RAM (or being promoted) or on disk; no lease, no promotion."""
        self._check_keys(keys)
        with self._lock:
            ns = self._namespace(ns_name)
            _, tiers = self._locate(ns, keys)
            return (tiers != 0).tolist()

    # -- time -------------------------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> None:
        """Expire leases and reservations, free quarantined slots, retry a degraded disk. Called periodically."""
        now = time.monotonic() if now is None else now
        if self._disk is not None and self._disk.degraded and now >= self._next_probe:
            self._next_probe = now + self.config.probe_interval_s
            self._disk.probe()  # outside the lock: it does I/O
        with self._lock:
            self._touches.apply()
            for _, ids in self._leases.expire(now):
                self.counters.lease_expirations += 1
                self._unlease(ids)
            cat = self._cat
            for rid, (_, eids) in self._reservations.expire(now):
                self._close(rid, "expired")
                self.counters.reservation_expirations += len(eids)
                for eid in eids:
                    cat.unindex(eid)
                    cat.state[eid] = _QUARANTINED
                    self._quarantine.append((now + self.config.quarantine_s, eid))
            while self._quarantine and self._quarantine[0][0] <= now:
                _, eid = self._quarantine.popleft()
                self._free(eid)
                self.counters.quarantine_freed += 1

    def note_checksum_failure(self) -> None:
        """Bytes that failed their checksum on the way in (counted; the block was not stored)."""
        with self._lock:
            self.counters.checksum_failures += 1
