"""The arena's space: which slots are taken, which block goes when one is needed, and the generation bump on free.

Owns the allocator, the generation table, the eviction policy (wrapped to take hints: policies/hinted.py; with
its deferred hit buffer, read_buffer.py)
and the tenant quotas. Every method is called under the engine's lock; none takes a lock or does I/O.

Eviction: an allocation that finds no slot asks the policy for victims among committed, unleased, unpinned
entries until it succeeds. After a commit that leaves allocated bytes above the high watermark, victims are
evicted down to the low watermark. Evicting a block that has a disk copy only drops the RAM copy. With tenant
quotas (quotas.py) victims come from over-quota tenants first, then, for an allocation, from the requesting
tenant's own blocks; no other tenant is evicted below its quota.

Write-backs (disk_write=evict): `write_back` (DiskLink's) may take a victim to write it to disk first. Its slot
is then freed only when the write lands (`writeback_landed`), so an allocation that needed it gets PENDING
instead of an offset once the victims it set writing cover its slot: Reserve raises RoomPending (the engine
waits for the writes outside its lock and tries again), a promotion waits for room (disk_link.py), a spare-slot
grant gives none. The watermark pass counts slots being written as already gone (`incoming_bytes`), so the
writes it starts ahead of need are what keeps puts from waiting.

Freeing a slot bumps its generation word: a reader that copied the slot and then sees another generation
treats its copy as a miss (that is what makes an expired lease safe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.catalog import ON_DISK, Catalog, EntryState, Namespace
from kvstore.engine.config import EngineConfig
from kvstore.engine.counters import Counters
from kvstore.engine.events import MOVED, REMOVED, EventBus
from kvstore.engine.generations import GenerationIndex
from kvstore.engine.misses import EVICTED, MissLedger
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.read_buffer import ReadBuffer
from kvstore.errors import StoreFullError
from kvstore.policies import EvictionPolicy
from kvstore.policies.hinted import with_hints
from kvstore.vocab import Tier

__all__ = ["RamSpace", "RoomPending", "PENDING"]

PENDING: Final = -1  # allocate(): no slot yet; victims are being written to make one (see the module docstring)


class RoomPending(Exception):
    """A Reserve must wait for victims' write-backs to land before it can have its slots (never leaves the engine:
    Engine.reserve waits outside its lock and tries again)."""

_COMMITTED = int(EntryState.COMMITTED)  # plain int: comparing a numpy scalar with an IntEnum costs ~13 us
_DOOMED = int(EntryState.DOOMED)


class RamSpace:
    """Allocate / evict / free arena slots for catalog entries. Called under the engine's lock."""

    def __init__(self, config: EngineConfig, cat: Catalog, layout: ArenaLayout, generations: np.ndarray,
                 allocator: SlabAllocator, policy: EvictionPolicy, quotas: TenantQuotas | None,
                 counters: Counters, events: EventBus, misses: MissLedger | None = None) -> None:
        self._config = config
        self._cat = cat
        self._gens = generations
        self._gen_index = GenerationIndex(layout)
        self._gen_stride = layout.gen_stride
        self.allocator = allocator
        self.policy = with_hints(policy)  # priorities and expiries for the engine's hints (hints.py)
        self._touches = ReadBuffer(self.policy)
        self._quotas = quotas if quotas is not None and quotas.enabled else None
        self._counters = counters
        self._events = events
        self._misses = misses if misses is not None else MissLedger(0)  # why keys left (evictions are written)
        # disk_write=evict: DiskLink.write_back takes victims to write before their slot is freed (True each)
        self.write_back: Callable[[list[int], bool], list[bool]] | None = None
        self.incoming_bytes = 0  # slot bytes of entries being written back: freed when their write lands

    # -- the policy's view ------------------------------------------------------------------------------
    def record_hits(self, ids: np.ndarray) -> None:
        """RAM hits, told to the policy later (in order) by `apply_touches`."""
        self._touches.record(ids)

    def apply_touches(self) -> None:
        """Replay buffered hits: before anything else touches the policy, and from the sweeper."""
        self._touches.apply()

    def insert(self, ns: Namespace, eids: Sequence[int]) -> None:
        """Entries that just became COMMITTED join the policy (after the hits recorded before them)."""
        self._touches.apply()
        self._policy_insert(ns, eids)

    def _policy_insert(self, ns: Namespace, eids: Sequence[int]) -> None:
        """The policy tracks `eids` (in order), with a fingerprint of each key only if it uses them."""
        policy, keys = self.policy, self._cat.keys
        policy.on_insert_many(eids, [hash(keys[e]) ^ ns.id for e in eids] if policy.wants_fingerprints else None)

    def commit(self, ns: Namespace, eids: list[int], checksums: Sequence[int]) -> None:
        """Reserved entries become COMMITTED (visible, evictable) and count toward their namespace."""
        self._touches.apply()  # the policy must see accesses and inserts in their real order
        size = self._cat.mark_committed(eids, checksums, ns)
        ns.blocks += len(eids)
        ns.bytes += size
        self._counters.committed_bytes += size
        self._policy_insert(ns, eids)
        ns.puts += len(eids)
        self._counters.committed_blocks += len(eids)
        if len(self._misses):
            keys = self._cat.keys
            self._misses.stored(ns.id, [keys[e] for e in eids])  # type: ignore[misc]  # a live entry's key is set (None only once dropped)

    def generations(self, offsets: np.ndarray) -> np.ndarray:
        """The current generation of the slots at `offsets` (int64 array)."""
        return self._gens[self._gen_index.of_many(offsets)]

    def slot_bytes(self, size: int) -> int:
        return self.allocator.slot_bytes(size)

    # -- allocation -------------------------------------------------------------------------------------
    def allocate_all(self, sizes: Sequence[int], todo: list[int], keep: set[int], tenant: str) -> list[int]:
        """A slot for each `sizes[i]`, i in `todo` (offsets by position, 0 elsewhere); all or nothing:
        StoreFullError (counted) when one cannot be found, with the others given back; RoomPending, with the
        others given back too, when victims for every slot were chosen but some are being written first (so
        one pass sets every write going, in victim order, and the retry finds their slots free)."""
        offsets = [0] * len(sizes)
        pending = False
        for i in todo:
            off = self.allocate(sizes[i], keep, tenant)
            if off is None and not pending:
                self._give_back(offsets, todo)
                self._counters.store_full += 1
                raise StoreFullError(self.full_message(sum(sizes[j] for j in todo)))
            if off is None or off == PENDING:
                pending = True
                continue
            offsets[i] = off
        if pending:
            self._give_back(offsets, todo)
            raise RoomPending()
        return offsets

    def _give_back(self, offsets: list[int], todo: list[int]) -> None:
        for j in todo:
            if offsets[j]:
                self.allocator.free(offsets[j])
                offsets[j] = 0

    def allocate(self, size: int, keep: set[int], tenant: str | None = None) -> int | None:
        """A slot of `size`, evicting as needed but never an entry in `keep`; `tenant` is who asks (quotas.py
        decides whose blocks may go). None: nothing left to evict; PENDING: the victims chosen are being
        written back and will free a slot when they land (disk_write=evict; see the module docstring).

        With isolate_tenants the slot comes from a slab bound to the tenant's own memory file (arena/backing.py),
        so only that tenant's processes can map it; evicting another tenant's blocks helps only once one of its
        slabs is empty and can move."""
        domain = self.domain(tenant)
        off = self.allocator.allocate(size, domain)
        if off is not None:
            return off
        eligible = (lambda eid: eid not in keep and self.evictable(eid)) if keep else self.evictable
        need, coming = self.allocator.slot_bytes(size), 0
        while off is None:
            victim = (self._choose_victim(eligible) if self._quotas is None
                      else self._choose_quota_victim(eligible, tenant))
            if victim is None:
                return PENDING if coming else None
            if not self.evict(victim):  # being written first: its slot comes later
                coming += self.allocator.slot_bytes(int(self._cat.size[victim]))
                if coming >= need:
                    return PENDING
                continue
            off = self.allocator.allocate(size, domain)
        return off

    def domain(self, tenant: str | None) -> str:
        """The memory file a tenant's slots come from: its own with isolate_tenants, else the shared one."""
        return (tenant or "") if self._config.isolate_tenants else ""

    def allocate_many(self, size: int, count: int, keep: set[int], tenant: str | None = None) -> list[int] | None:
        """`count` slots of `size` (`allocate` of each), all or none: the free ones in one allocator call, then
        one eviction a slot; None, with the ones found given back, when the rest cannot be made free."""
        out = self.allocator.allocate_many(size, count, self.domain(tenant))
        while len(out) < count:
            off = self.allocate(size, keep, tenant)
            if off is None or off == PENDING:  # (PENDING: the write-backs it started free slots later)
                for got in out:
                    self.free_slot(got)
                return None
            out.append(off)
        return out

    def full_message(self, wanted: int) -> str:
        alloc = self.allocator
        return (
            f"store full: cannot place {wanted} bytes; {alloc.allocated_bytes} of {alloc.capacity} arena bytes are "
            f"allocated, {alloc.free_slabs} of {alloc.n_slabs} slabs ({alloc.slab_bytes} bytes each) free, and "
            "nothing else is evictable (leased, pinned or reserved). Release leases, unpin blocks, use fewer "
            "distinct block sizes per batch (each size class needs a slab), or give the daemon a larger arena_bytes"
            + ("; tenant_ram_quota protects other tenants' blocks up to their quotas" if self._quotas else "")
        )

    def enforce_watermarks(self) -> None:
        """Above the high watermark, evict down to the low one (after a commit). Slots being written back count
        as gone already: their writes are under way."""
        alloc, cfg = self.allocator, self._config
        if alloc.allocated_bytes - self.incoming_bytes <= cfg.high_watermark * alloc.capacity:
            return
        target = cfg.low_watermark * alloc.capacity
        if self._quotas is None:  # choose every victim first (the policy forgets each), then one evict_many
            excess, victims = alloc.allocated_bytes - self.incoming_bytes - target, []
            self._touches.apply()  # once: choosing victims records no hits
            choose, evictable, sizes = self.policy.choose_victim, self.evictable, self._cat.size
            while excess > 0 and (victim := choose(evictable)) is not None:
                victims.append(victim)
                excess -= alloc.slot_bytes(int(sizes[victim]))
            self.evict_many(victims)
            return
        while alloc.allocated_bytes - self.incoming_bytes > target:  # quotas: whose blocks may go depends on the
            # usage after each one (a victim being written back counts as gone: incoming_bytes grew)
            victim = self._choose_quota_victim(self.evictable, None, own_pass=False)
            if victim is None:
                return
            self.evict(victim)

    # -- eviction ---------------------------------------------------------------------------------------
    def evictable(self, eid: int) -> bool:
        cat = self._cat
        return cat.state[eid] == _COMMITTED and cat.leases[eid] == 0 and cat.pins[eid] == 0

    def _choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        self._touches.apply()
        return self.policy.choose_victim(eligible)

    def _choose_quota_victim(self, eligible: Callable[[int], bool], tenant: str | None,
                             own_pass: bool = True) -> int | None:
        """Over-quota tenants' blocks first, then (allocation only) the acting tenant's own; see quotas.py."""
        assert self._quotas is not None
        cat = self._cat
        tenant_of = lambda eid: cat.namespace_of(eid).tenant  # noqa: E731
        over = self._quotas.over_quota(TenantQuotas.usage(cat.namespaces), tenant_of, lambda eid: int(cat.size[eid]))
        victim = self._choose_victim(lambda eid: eligible(eid) and over(eid))
        if victim is None and own_pass and tenant is not None:
            victim = self._choose_victim(lambda eid: eligible(eid) and tenant_of(eid) == tenant)
        return victim

    def evict_many(self, eids: list[int]) -> None:
        """`evict` of each, with one KV event per kind, one miss-ledger call and one key-index removal per
        namespace instead of one each per block: a Store of 32 blocks into a full arena evicts 32, and the
        per-block calls were half of its time. Victims taken for a write-back (one queueing, in order) go later."""
        if eids and self.write_back is not None:
            eids = [e for e, taken in zip(eids, self._take_for_writing(eids)) if not taken]
        if len(eids) < 2:
            for eid in eids:
                self._drop(eid)
            return
        cat, counters = self._cat, self._counters
        by_ns: dict[int, list[int]] = {}
        for eid in eids:
            by_ns.setdefault(int(cat.ns[eid]), []).append(eid)
        for ns_id, group in by_ns.items():
            ns = cat.namespaces[ns_id]
            keys: list[bytes] = [cat.keys[e] for e in group]  # type: ignore[misc]  # a live entry's key is set (None only once dropped)
            kept = [bool(cat.flags[e] & ON_DISK) for e in group]  # the disk tier keeps these: only RAM goes
            if self._events.subscribers:
                self._events.publish(MOVED, ns.name, [k for k, d in zip(keys, kept) if d], Tier.RAM, Tier.DISK)
                self._events.publish(REMOVED, ns.name, [k for k, d in zip(keys, kept) if not d], Tier.RAM)
            counters.evicted_to_disk += sum(kept)
            if self._misses.capacity:
                self._misses.left(ns_id, [k for k, d in zip(keys, kept) if not d], EVICTED)
            sizes = cat.size[group].tolist()
            ns.blocks -= len(group)
            ns.bytes -= sum(sizes)
            cat.unindex_many(ns, group, keys)
            offsets = cat.offset[group]
            self._gens[self._gen_index.of_many(offsets.astype(np.int64))] += 1  # distinct slots: no np.add.at
            self.allocator.free_many(offsets.tolist())
            cat.drop_many(group)
            counters.evictions += len(group)
            counters.evicted_bytes += sum(sizes)

    def evict(self, eid: int) -> bool:
        """Evict a committed entry the policy has already forgotten: True when its slot is free now, False when
        DiskLink took it to write it first (disk_write=evict: freed by `writeback_landed`)."""
        if self.write_back is not None and self._take_for_writing([eid])[0]:
            return False
        self._drop(eid)
        return True

    def demote(self, eid: int) -> bool:
        """A Demote hint under disk_write=evict: write the entry back now (admission and the budget bypassed), as
        an eviction; True when taken (the caller takes it out of the policy)."""
        return self.write_back is not None and self._take_for_writing([eid], force=True)[0]

    def _take_for_writing(self, eids: list[int], force: bool = False) -> list[bool]:
        assert self.write_back is not None
        taken = self.write_back(eids, force)
        sizes = self._cat.size
        self.incoming_bytes += sum(self.allocator.slot_bytes(int(sizes[e])) for e, t in zip(eids, taken) if t)
        return taken

    def writeback_landed(self, eid: int) -> None:
        """The write-back of `eid` ended (its flags say how: ON_DISK when it landed). Its slot goes now, unless a
        reader or a pin took the entry meanwhile: then it stays in RAM, tracked by the policy again (with its disk
        copy, if the write landed). A deleted entry (DOOMED) is freed by its last holder, not here."""
        cat = self._cat
        self.incoming_bytes -= self.allocator.slot_bytes(int(cat.size[eid]))
        if cat.state[eid] != _COMMITTED:
            return
        if cat.leases[eid] or cat.pins[eid]:
            self._touches.apply()
            self._policy_insert(cat.namespace_of(eid), [eid])
            return
        self._drop(eid)

    def _drop(self, eid: int) -> None:
        """Free a committed entry's slot as an eviction: the block lives on on disk (ON_DISK) or is gone."""
        cat, counters = self._cat, self._counters
        size = int(cat.size[eid])
        if self._events.subscribers:
            ns, key = cat.namespace_of(eid).name, cat.keys[eid]
            if cat.flags[eid] & ON_DISK:
                self._events.publish(MOVED, ns, [key], Tier.RAM, Tier.DISK)  # type: ignore[list-item]  # a live entry's key is set (None only once dropped)
            else:
                self._events.publish(REMOVED, ns, [key], Tier.RAM)  # type: ignore[list-item]  # a live entry's key is set (None only once dropped)
        if cat.flags[eid] & ON_DISK:
            counters.evicted_to_disk += 1  # the disk tier keeps it: only the RAM copy goes
        elif self._misses.capacity:
            self._misses.left(int(cat.ns[eid]), (cat.keys[eid],), EVICTED)  # type: ignore[arg-type]  # a live entry's key is set (None only once dropped)
        self.forget_committed(eid)
        self.free(eid)
        counters.evictions += 1
        counters.evicted_bytes += size

    def delete(self, eid: int, counted: bool = True) -> None:
        """Remove a COMMITTED entry on request: freed now, or DOOMED (invisible) until its last lease goes.
        `counted`: a delete a client asked for (deleted_blocks); the peer tier's dropped guests are not."""
        cat = self._cat
        self._touches.apply()
        self.policy.on_remove(eid)
        if self._events.subscribers:
            self._events.publish(REMOVED, cat.namespace_of(eid).name, [cat.keys[eid]], Tier.RAM)  # type: ignore[list-item]  # a live entry's key is set (None only once dropped)
        self.forget_committed(eid)
        self._counters.deleted_blocks += counted
        if cat.leases[eid] > 0:
            cat.state[eid] = _DOOMED
        else:
            self.free(eid)

    def forget_committed(self, eid: int) -> None:
        """Unindex a committed entry and take it out of its namespace's counts (its slot stays taken)."""
        cat = self._cat
        ns = cat.namespace_of(eid)
        ns.blocks -= 1
        ns.bytes -= int(cat.size[eid])
        cat.unindex(eid)

    def free(self, eid: int) -> None:
        """Return an entry's slot. The generation bump is what makes any outstanding copy of it a miss."""
        self.free_slot(int(self._cat.offset[eid]))
        self._cat.drop(eid)

    def bump_generations_but(self, held: np.ndarray) -> None:
        """A restart that adopted a predecessor's blocks: bump the generation word of every page but the slots at
        `held` (what this engine holds now) and the slabs' epoch words, so an offset a client kept of anything
        else (a block that was not adopted, whatever its record said) reads as a miss. O(arena pages), numpy."""
        n_slabs, stride = self.allocator.n_slabs, self._gen_stride
        bump = np.ones(n_slabs * stride, dtype=bool)
        bump[::stride] = False  # epochs: GPU registrations stay valid
        if len(held):
            bump[self._gen_index.of_many(np.asarray(held, dtype=np.int64))] = False
        self._gens[:n_slabs * stride][bump] += np.uint64(1)

    def free_slot(self, offset: int) -> None:
        """Return a slot no entry holds (a spare slot, spares.py), with the same generation bump as `free`."""
        self._gens[self._gen_index.of(offset)] += 1
        self.allocator.free(offset)

    def pin(self, ns: Namespace, keys: Sequence[bytes], delta: int) -> int:
        """delta=+1 pins, -1 unpins committed keys (a pinned block is never evicted); how many changed."""
        index, cat = ns.index, self._cat
        changed = 0
        for key in keys:
            eid = index.get(key)
            if eid is None or cat.state[eid] != _COMMITTED:
                continue
            pins = int(cat.pins[eid]) + delta
            if 0 <= pins <= 0xFFFF:
                cat.pins[eid] = pins
                changed += 1
        return changed

    def tenant_usage(self) -> dict[str, int]:
        """RAM payload bytes per tenant (what quotas compare against)."""
        return TenantQuotas.usage(self._cat.namespaces)
