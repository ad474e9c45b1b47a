"""An engine's state handed to a successor process: what the old daemon exports, what the new one adopts.

A block's life across a hand-over restart (catalog.py's state machine, continued in the next process)::

    old daemon                                   successor
    COMMITTED, journal record verified  -------> COMMITTED at the same entry id and serial (the shared key
                                                 index's ids stay true), in the eviction order it had
    COMMITTED, record fails a check     -------> dropped: its slot's generation bumped, counted by reason
    RESERVED (an open reservation)      -------> RESERVED under the same reservation id and deadline
    DOOMED (deleted, still leased)      -------> DOOMED: freed at its last release
    spare, quarantined or PROMOTING slot ------> quarantined: freed at its deadline (generation bumped)
    leases                              -------> same ids and deadlines (entries dropped leave them)
    pins, hint pins, retentions         -------> as they were, with their deadlines

After a crash (systemd's fd store) only the journal speaks: its verified entries are adopted, nothing else.
Checked here, on top of what kvstore/arena/verify.py checked of each record against the arena (generation,
slot geometry, xxh3 of the bytes): the namespace is known, the key is not adopted twice, the slot fits the
allocator's grid without overlapping another (SlabAllocator.restore), and the slot lives in the memory file
of the namespace's tenant (a block of tenant A in a slab bound to B's file would be readable by B: dropped).

`export_live` and `adopt` run under the engine's lock (Engine.export_live / Engine.adopt), the engine idle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.engine.catalog import ON_DISK, Catalog, EntryState, Namespace
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.hints import Hints
from kvstore.engine.key_mirror import KeyIndexMirror
from kvstore.engine.leases import LeaseTable
from kvstore.engine.ram_space import RamSpace
from kvstore.engine.reservations import ReservationTable
from kvstore.engine.spares import SpareSlots
from kvstore.policies.hinted import RELEASED, RETAINED

__all__ = ["HeldEntry", "LiveState", "AdoptedEntries", "AdoptReport", "Parts", "export_live", "adopt"]

_COMMITTED, _RESERVED = int(EntryState.COMMITTED), int(EntryState.RESERVED)
_DOOMED, _QUARANTINED = int(EntryState.DOOMED), int(EntryState.QUARANTINED)
_PROMOTING = int(EntryState.PROMOTING)


@dataclass(frozen=True)
class HeldEntry:
    """An entry the journal does not describe (not committed): a reservation's or a doomed one."""

    eid: int
    ns_id: int
    key: bytes
    offset: int
    size: int
    serial: int


@dataclass
class LiveState:
    """What only a running daemon knows; empty after a crash. Seconds are relative to the export."""

    serial: int = 0
    lease_next_id: int = 0
    reservation_next_id: int = 0
    leases: list[tuple[int, list[int], float]] = field(default_factory=list)            # id, entries, left
    reservations: list[tuple[int, int, list[int], float]] = field(default_factory=list)  # id, ns, entries, left
    reserved: list[HeldEntry] = field(default_factory=list)
    doomed: list[HeldEntry] = field(default_factory=list)
    held: list[tuple[int, int, float]] = field(default_factory=list)   # slot offset, slot bytes, seconds to free
    pins: dict[int, int] = field(default_factory=dict)                  # entry -> pins given by Pin RPCs
    hint_pins: list[tuple[int, float]] = field(default_factory=list)    # entry, seconds left
    priorities: list[tuple[int, int, float]] = field(default_factory=list)  # entry, priority, seconds left
    order: list[int] = field(default_factory=list)                      # committed entries, next victim first


@dataclass(frozen=True)
class AdoptedEntries:
    """Journal entries that passed verify.py: to be placed at their ids. `rejected`: the (namespace id, key) of
    records that failed a check after their header (a kept key index must not list them)."""

    eids: np.ndarray
    ns_ids: np.ndarray
    keys: list[bytes]
    offsets: np.ndarray
    sizes: np.ndarray
    checksums: np.ndarray
    serials: np.ndarray
    rejected: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class AdoptReport:
    blocks: int = 0
    bytes: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> blocks not adopted here
    leases: int = 0
    reservations: int = 0
    queued_writes: int = 0

    def drop(self, reason: str, n: int = 1) -> None:
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n


@dataclass(frozen=True)
class Parts:
    """The engine's parts an export or adoption touches (Engine passes its own)."""

    cat: Catalog
    ram: RamSpace
    leases: LeaseTable
    reservations: ReservationTable
    spares: SpareSlots
    hints: Hints
    disk: DiskLink
    mirror: KeyIndexMirror | None


def export_live(p: Parts, now: float) -> LiveState:
    """The live state of an idle engine (under its lock): what `adopt` rebuilds in the successor."""
    cat = p.cat
    live = LiveState(serial=int(cat._serial), lease_next_id=p.leases.next_id,
                     reservation_next_id=p.reservations.next_id)
    live.leases = [(lid, ids.tolist(), left) for lid, ids, left in p.leases.live(now)]
    for rid, (ns, eids), left in p.reservations.live(now):
        live.reservations.append((rid, ns.id, list(eids), left))
        live.reserved += [_held(cat, e) for e in eids if cat.state[e] == _RESERVED]
    n = len(cat.keys)
    live.doomed = [_held(cat, e) for e in np.flatnonzero(cat.state[:n] == _DOOMED).tolist()]
    slot_of = p.ram.slot_bytes
    live.held = [(int(cat.offset[e]), slot_of(int(cat.size[e])), left) for e, left in p.reservations.quarantined(now)]
    live.held += [(int(cat.offset[e]), slot_of(int(cat.size[e])), 0.0)  # a read in flight is abandoned
                  for e in np.flatnonzero(cat.state[:n] == _PROMOTING).tolist()]
    live.held += p.spares.held(now)
    hint_pins = p.hints.pins_left(now)
    live.hint_pins = hint_pins
    by_hint = {e for e, _ in hint_pins}
    for eid in np.flatnonzero(cat.pins[:n] > 0).tolist():
        manual = int(cat.pins[eid]) - (1 if eid in by_hint else 0)
        if manual > 0:
            live.pins[eid] = manual
    live.priorities = p.ram.policy.hinted(now)
    live.order = p.ram.policy.order()
    return live


def _held(cat: Catalog, eid: int) -> HeldEntry:
    return HeldEntry(eid, int(cat.ns[eid]), cat.keys[eid] or b"", int(cat.offset[eid]), int(cat.size[eid]),
                     int(cat.serial[eid]))


def adopt(p: Parts, entries: AdoptedEntries, live: LiveState | None, lost_namespaces: set[int],
          slab_domain: Callable[[int], str], slab_of: Callable[[int], int], now: float,
          tables_kept: bool) -> tuple[AdoptReport, list[tuple[int, bytes]]]:
    """Place verified entries (and, after a hand-over, the live state) in a fresh engine. Returns the report
    and the (namespace id, key) of journal entries not adopted (the caller clears their records; with
    `tables_kept` they are also taken out of the shared key index here, else the fresh index gets the adopted
    ones). Every slot not held now has its generation bumped: an offset a client still has of it reads as a miss."""
    cat, ram, report = p.cat, p.ram, AdoptReport()
    live = live or LiveState()
    keep = _checked(cat, entries, lost_namespaces, report, lambda ns_id: ram.domain(cat.namespaces[ns_id].tenant),
                    slab_domain, slab_of)
    taken_ids = set(entries.eids[keep].tolist())
    taken_keys = {(n, k) for n, k, ok in zip(entries.ns_ids.tolist(), entries.keys, keep.tolist()) if ok}
    reserved = [h for h in live.reserved if h.ns_id < len(cat.namespaces) and h.ns_id not in lost_namespaces
                and h.eid not in taken_ids and (h.ns_id, h.key) not in taken_keys]
    doomed = [h for h in live.doomed if h.ns_id < len(cat.namespaces) and h.eid not in taken_ids]
    extra = reserved + doomed
    slots = [(int(o), int(s)) for o, s in zip(entries.offsets[keep], entries.sizes[keep])]
    slots += [(h.offset, h.size) for h in extra] + [(off, cls) for off, cls, _ in live.held]
    refused = set(ram.allocator.restore([slab_domain(s) for s in range(ram.allocator.n_slabs)], slots))
    n_keep, n_extra = int(keep.sum()), len(extra)
    ok = np.array([i not in refused for i in range(n_keep)], dtype=bool)
    report.drop("slot", int((~ok).sum()))
    placed = np.flatnonzero(keep)[ok]
    extra = [h for i, h in enumerate(extra) if n_keep + i not in refused]
    live.held = [h for i, h in enumerate(live.held) if n_keep + n_extra + i not in refused]
    reserved_ids = {h.eid for h in reserved}
    states = [_RESERVED if h.eid in reserved_ids else _DOOMED for h in extra]
    ext = lambda f: np.array([getattr(h, f) for h in extra], dtype=np.int64)  # noqa: E731
    cat.restore(np.concatenate([entries.eids[placed], ext("eid")]),
                np.concatenate([entries.ns_ids[placed], ext("ns_id")]),
                [entries.keys[i] for i in placed.tolist()] + [h.key for h in extra],
                np.concatenate([entries.offsets[placed], ext("offset")]),
                np.concatenate([entries.sizes[placed], ext("size")]),
                np.concatenate([entries.checksums[placed], np.zeros(len(extra), dtype=np.uint64)]),
                np.concatenate([entries.serials[placed], ext("serial")]),
                np.concatenate([np.full(len(placed), _COMMITTED), np.array(states, dtype=np.int64)]),
                serial=live.serial)
    adopted = entries.eids[placed]
    _count(cat, adopted, report)
    _policy(cat, ram, adopted, live.order)
    _live(p, live, now, report)
    _loose_ends(p, [h.eid for h in extra])
    report.queued_writes = _disk(cat, p.disk, adopted)
    gone_idx = np.setdiff1d(np.arange(len(entries.eids)), placed)
    gone = [(int(entries.ns_ids[i]), entries.keys[i]) for i in gone_idx.tolist()] + list(entries.rejected)
    # every slot this engine does not hold now: its generation moves on, so whatever offset a client still has
    # of it (a dropped block's, a record too damaged to name its key) is a miss, never another block's bytes
    held = np.concatenate([entries.offsets[placed], np.array([h.offset for h in extra] +
                                                             [off for off, _, _ in live.held], dtype=np.int64)])
    ram.bump_generations_but(held)
    _mirror(cat, p.mirror, adopted, gone, tables_kept)
    return report, gone


def _loose_ends(p: Parts, extra: list[int]) -> None:
    """A RESERVED entry whose reservation did not come over, a DOOMED one no lease holds: freed now."""
    cat, held = p.cat, p.reservations.held_ids()
    for eid in extra:
        if cat.state[eid] == _RESERVED and eid not in held:
            cat.unindex(eid)
            p.ram.free(eid)
        elif cat.state[eid] == _DOOMED and cat.leases[eid] == 0:
            p.ram.free(eid)


def _checked(cat: Catalog, e: AdoptedEntries, lost: set[int], report: AdoptReport,
             domain_of_ns: Callable[[int], str], slab_domain: Callable[[int], str],
             slab_of: Callable[[int], int]) -> np.ndarray:
    """Which entries may be placed: a known namespace, a key not seen before, a slot in the tenant's file."""
    keep = np.ones(len(e.eids), dtype=bool)
    seen: set[tuple[int, bytes]] = set()
    n_ns = len(cat.namespaces)
    for i, (ns_id, key, off) in enumerate(zip(e.ns_ids.tolist(), e.keys, e.offsets.tolist())):
        if ns_id >= n_ns or ns_id in lost:
            keep[i] = False
            report.drop("namespace")
        elif (ns_id, key) in seen:
            keep[i] = False
            report.drop("duplicate")
        elif slab_domain(slab_of(off)) != domain_of_ns(ns_id):
            keep[i] = False
            report.drop("tenant_file")
        else:
            seen.add((ns_id, key))
    return keep


def _count(cat: Catalog, adopted: np.ndarray, report: AdoptReport) -> None:
    sizes = cat.size[adopted]
    for ns_id, size in zip(cat.ns[adopted].tolist(), sizes.tolist()):
        ns = cat.namespaces[ns_id]
        ns.blocks += 1
        ns.bytes += size
    report.blocks, report.bytes = len(adopted), int(sizes.sum())


def _policy(cat: Catalog, ram: RamSpace, adopted: np.ndarray, order: Sequence[int]) -> None:
    """Insert the adopted entries in the predecessor's eviction order (the rest after, by id)."""
    mine = set(adopted.tolist())
    first = [e for e in order if e in mine]
    rest = sorted(mine.difference(first))
    ids = first + rest
    fps = [hash(cat.keys[e]) ^ int(cat.ns[e]) for e in ids] if ram.policy.wants_fingerprints else None
    ram.policy.on_insert_many(ids, fps)


def _live(p: Parts, live: LiveState, now: float, report: AdoptReport) -> None:
    cat = p.cat
    n = len(cat.keys)
    present = lambda eid: 0 <= eid < n and cat.state[eid] in (_COMMITTED, _DOOMED)  # noqa: E731
    for lid, eids, left in sorted(live.leases, key=lambda t: t[2]):
        ids = np.array([e for e in eids if present(e)], dtype=np.int64)
        p.leases.restore(lid, ids, left, live.lease_next_id)
        report.leases += 1
    p.leases.continue_ids(live.lease_next_id)
    for rid, ns_id, eids, left in sorted(live.reservations, key=lambda t: t[3]):
        mine = [e for e in eids if 0 <= e < n and cat.state[e] == _RESERVED and int(cat.ns[e]) == ns_id]
        if mine:
            p.reservations.restore(rid, cat.namespaces[ns_id], mine, left, live.reservation_next_id)
            report.reservations += 1
    p.reservations.continue_ids(live.reservation_next_id)
    for off, cls, left in live.held:
        p.spares.hold(off, cls, left, now)
    p.spares.sort_quarantine()
    for eid, pins in live.pins.items():
        if 0 <= eid < n and cat.state[eid] == _COMMITTED:
            cat.pins[eid] = min(pins, 0xFFFF)
    for eid, left in live.hint_pins:
        if 0 <= eid < n and cat.state[eid] == _COMMITTED:
            p.hints.restore_pin(cat.namespace_of(eid), eid, left, now)
    for eid, prio, left in live.priorities:
        if 0 <= eid < n and cat.state[eid] == _COMMITTED and prio in (RETAINED, RELEASED):
            p.ram.policy.set_priority(eid, prio, now + left)


def _disk(cat: Catalog, disk: DiskLink, adopted: np.ndarray) -> int:
    """Mark adopted blocks the disk tier holds; under disk_write = commit, queue the others' writes when admission
    takes a first use (under evict they are written when RAM evicts them, as any block)."""
    if disk.store is None or not len(adopted):
        return 0
    by_ns: dict[int, list[int]] = {}
    for eid, ns_id in zip(adopted.tolist(), cat.ns[adopted].tolist()):
        by_ns.setdefault(ns_id, []).append(eid)
    queued = 0
    for ns_id, eids in by_ns.items():
        ns: Namespace = cat.namespaces[ns_id]
        on_disk = disk.contains_many(ns.name, [cat.keys[e] for e in eids])  # type: ignore[misc]  # committed
        missing = []
        for eid, length in zip(eids, on_disk):
            if length:
                cat.flags[eid] |= ON_DISK
            else:
                missing.append(eid)
        if missing and disk.write_mode == "commit" and disk.admission.admits(1):
            before = disk.queued_writes
            disk.queue_writes(np.array(missing, dtype=np.int64))
            queued += disk.queued_writes - before
    return queued


def _mirror(cat: Catalog, mirror: KeyIndexMirror | None, adopted: np.ndarray, gone: list[tuple[int, bytes]],
            tables_kept: bool) -> None:
    if mirror is None:
        return
    if tables_kept:
        by_ns: dict[int, list[bytes]] = {}
        for ns_id, key in gone:
            if ns_id < len(cat.namespaces):
                by_ns.setdefault(ns_id, []).append(key)
        for ns_id, keys in by_ns.items():
            ns = cat.namespaces[ns_id]
            held = [k for k in keys if ns.index.get(k) is None]  # a key adopted under another id stays
            if held:
                mirror.removed(ns, held)
        return
    by_ns_ids: dict[int, list[int]] = {}
    for eid, ns_id in zip(adopted.tolist(), cat.ns[adopted].tolist()):
        by_ns_ids.setdefault(ns_id, []).append(eid)
    for ns_id, eids in by_ns_ids.items():
        mirror.added(eids, cat.namespaces[ns_id])
