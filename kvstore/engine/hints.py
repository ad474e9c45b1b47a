"""Agent hints in the engine: metadata on entries that the eviction policy and the tiers act on.

`Engine.hint(ns, keys, action, ttl_s)` answers one HintOutcome per key (kvstore/hint_vocab.py); a key stored
in no tier is MISSING for every action. Per action:

    RETAIN    RAM entry: kept until now + ttl_s while any other entry can go (HintedPolicy's RETAINED; still
              evictable under pressure) -> ACCEPTED, or CLIPPED when ttl_s > hint_max_ttl_s (the max is used).
              Only on disk -> REJECTED: prefetch it first.
    RELEASE   lets go on both tiers. RAM entry: first to go (RELEASED), and written nowhere when it goes (a later
              Retain or Pin undoes both) -> ACCEPTED; its disk copy, if any, is deleted. Only on disk: the disk
              copy is deleted -> ACCEPTED. (disk_link.py `let_go`; the deletes run after the lock.)
    DEMOTE    no disk tier -> REJECTED. Only on disk -> ACCEPTED. In RAM with a disk copy: the RAM copy is
              dropped now -> ACCEPTED (pinned -> REJECTED; leased -> DEFERRED, released: first to go). Without
              one: written now, bypassing admission and the write budget (charged to it): under
              disk_write=evict as an eviction's write-back (out of the policy at once, its slot freed when the
              write lands), under commit queued as write-behind and the RAM copy dropped when the write lands
              -> DEFERRED (the write queue full -> REJECTED).
    PREFETCH  the engine runs a probe Lookup first (lease-less: disk and peer hits start their promotion, as a
              scheduler's probe does); present in any tier -> ACCEPTED.
    PIN       RAM entry: never evicted until now + ttl_s (the catalog's pin count, as Engine.pin), its bytes
              counted against the tenant's pinned budget: its RAM quota (tenant_ram_quota), or half the arena
              with no quotas. Over budget -> REJECTED; pinned again -> deadline extended, bytes counted once.
              ACCEPTED or CLIPPED as for RETAIN. Only on disk -> REJECTED. Expired by `expire` (the sweeper).

A key still being written (RESERVED: its writer's Commit is pending) or being promoted (PROMOTING: its disk
read in flight, e.g. after a Prefetch) answers DEFERRED for Retain, Release, Demote (with a disk tier) and Pin
(PREFETCH: ACCEPTED): the hint is kept and applied as above when the entry commits or its promotion lands, with
the deadline the hint gave (the latest hint of each action wins, in the order they came). A Pin that finds the
budget spent by then (or a Demote whose write queue is full) is counted as `hints_late_rejected`; the hints of
an aborted or expired reservation, or of a failed promotion, are dropped with its slot.

Pins set by Engine.pin are not counted: the budget bounds what agents may hold. Called under the engine's lock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.engine.catalog import EVICTING, GUEST, ON_DISK, QUEUED, WRITING, Catalog, EntryState, Namespace
from kvstore.engine.config import EngineConfig
from kvstore.engine.counters import Counters
from kvstore.engine.disk_link import DiskLink
from kvstore.engine.lookups import Lookups
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.ram_space import RamSpace
from kvstore.errors import InvalidRequestError
from kvstore.hint_vocab import HintAction, HintOutcome
from kvstore.policies.hinted import NORMAL, RELEASED, RETAINED, HintedPolicy
from kvstore.vocab import Tier

__all__ = ["Hints", "parse_hint"]

_COMMITTED = int(EntryState.COMMITTED)
_RESERVED = int(EntryState.RESERVED)
_PROMOTING = int(EntryState.PROMOTING)
_NONE, _RAM = int(Tier.NONE), int(Tier.RAM)
ACCEPTED, CLIPPED, DEFERRED = HintOutcome.ACCEPTED, HintOutcome.CLIPPED, HintOutcome.DEFERRED
REJECTED, MISSING = HintOutcome.REJECTED, HintOutcome.MISSING
_ACTIONS = ", ".join(a.value for a in HintAction)


def parse_hint(action: HintAction | str, ttl_s: float) -> tuple[HintAction, float]:
    """The action and ttl of a hint, checked before the lock; InvalidRequestError says what to send instead."""
    try:
        act = action if isinstance(action, HintAction) else HintAction(str(action).lower())
    except ValueError:
        raise InvalidRequestError(f"unknown hint action {action!r}: use one of {_ACTIONS}") from None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s < 0:
        raise InvalidRequestError(f"hint ttl_s={ttl_s!r}: use a finite number of seconds >= 0")
    if act in (HintAction.RETAIN, HintAction.PIN) and ttl_s <= 0:
        raise InvalidRequestError(f"hint {act.value} needs ttl_s > 0 (how long to keep the blocks), got {ttl_s}")
    return act, float(ttl_s)


@dataclass
class _Pin:
    key: bytes
    ns_id: int
    tenant: str
    size: int
    until: float


class Hints:
    """What hints do to entries (see the module docstring). Called under the engine's lock."""

    def __init__(self, config: EngineConfig, cat: Catalog, ram: RamSpace, disk: DiskLink, lookups: Lookups,
                 counters: Counters, quotas: TenantQuotas | None) -> None:
        assert isinstance(ram.policy, HintedPolicy), "the engine wraps its policy (policies/hinted.py)"
        self._max_ttl = config.hint_max_ttl_s
        self._cat, self._ram, self._disk, self._lookups = cat, ram, disk, lookups
        self._policy: HintedPolicy = ram.policy
        self._counters = counters
        self._quotas = quotas if quotas is not None and quotas.enabled else None
        self._pins: dict[int, _Pin] = {}          # eid -> its hint pin
        self._pin_heap: list[tuple[float, int]] = []  # (until, eid), stale ones skipped
        self._pinned: dict[str, int] = {}         # tenant -> bytes pinned by hints
        self._demoting: dict[int, bytes] = {}     # eid -> key: RAM copy to drop once its disk write lands
        # eid -> (key, namespace, action -> (until, outcome if timed)): hints on entries awaiting their Commit
        self._waiting: dict[int, tuple[bytes, Namespace, dict[HintAction, tuple[float, HintOutcome]]]] = {}
        disk.on_written = self._written
        disk.on_promoted = self._promoted

    def apply(self, ns: Namespace, keys: Sequence[bytes], act: HintAction, ttl_s: float, now: float,
              probed: Sequence[int] | None = None) -> list[str]:
        """One outcome per key; `probed`: the tiers a PREFETCH's probe Lookup found."""
        self._ram.apply_touches()  # the policy must see earlier hits before entries leave it
        self.expire(now)
        eids, tiers = self._lookups.locate(ns, keys)
        tier_list = list(probed) if probed is not None else tiers.tolist()
        ttl = min(ttl_s, self._max_ttl)
        timed = CLIPPED if ttl_s > self._max_ttl else ACCEPTED
        out: list[str] = []
        state = self._cat.state
        for key, eid, tier in zip(keys, eids.tolist(), tier_list):
            if tier == _NONE:
                res = self._defer(ns, eid, key, act, now + ttl, timed) if eid >= 0 and state[eid] == _RESERVED \
                    else MISSING
            elif act is HintAction.PREFETCH:
                res = ACCEPTED
            elif eid >= 0 and state[eid] == _PROMOTING:  # its read lands soon: then it is a RAM entry
                res = self._defer(ns, eid, key, act, now + ttl, timed)
            elif tier != _RAM or state[eid] != _COMMITTED:  # on disk only (eid < 0)
                res = self._not_in_ram(act)
                if act is HintAction.RELEASE:
                    self._disk.let_go(ns, key, -1)
            else:
                res = self._act(ns, eid, key, act, now + ttl, timed)
            out.append(res.value)
            setattr(self._counters, f"hint_{act.value}_{res.value}",
                    getattr(self._counters, f"hint_{act.value}_{res.value}") + 1)
        return out

    def _act(self, ns: Namespace, eid: int, key: bytes, act: HintAction, until: float,
             timed: HintOutcome) -> HintOutcome:
        """A hint on a committed RAM entry (every action but PREFETCH, which needs nothing more)."""
        if act is HintAction.RETAIN:
            self._policy.set_priority(eid, RETAINED, until)
            self._disk.keep_again(eid)
            return timed
        if act is HintAction.RELEASE:
            self._policy.set_priority(eid, RELEASED)
            self._disk.let_go(ns, key, eid)
            return ACCEPTED
        if act is HintAction.DEMOTE:
            return self._demote(eid, key)
        res = self._pin(ns, eid, key, until, timed)
        if res is not REJECTED:
            self._disk.keep_again(eid)
        return res

    def let_go(self, ns: Namespace, keys: Sequence[bytes], drop: bool = False) -> int:
        """The peer tier's word on copies this node does not own (pushed to their owner, fetched from it, or
        handed to a new one), so a cluster's RAM holds each block about once: first to go, as a Release makes
        them, or with `drop` their RAM copy goes now: as an eviction would take it, or, when a reader holds it
        (a load that fetched it), hidden from every later lookup at once and freed when that reader lets go, as
        a delete of a leased block is (a disk copy stays either way, and under disk_write = evict its eviction
        never writes one: GUEST). An entry an agent's hint or a pin marked is left as it is; not counted as a
        hint or a delete. Returns the entries marked or dropped."""
        self._ram.apply_touches()
        eids, _ = self._lookups.locate(ns, keys)
        state, pins, flags = self._cat.state, self._cat.pins, self._cat.flags
        done = 0
        for eid in eids.tolist():
            if eid < 0 or state[eid] != _COMMITTED or pins[eid] or self._policy.priority(eid) == RETAINED:
                continue
            flags[eid] |= GUEST
            if drop and self._ram.evictable(eid):
                self._policy.on_remove(eid)
                self._ram.evict(eid)
                done += 1
            elif drop and self._cat.leases[eid]:  # a reader holds it: hidden now, freed when it lets go
                self._ram.delete(eid, counted=False)
                done += 1
            elif self._policy.priority(eid) == NORMAL:
                done += self._policy.set_priority(eid, RELEASED)
        return done

    # -- hints on blocks still being written ------------------------------------------------------------
    def _defer(self, ns: Namespace, eid: int, key: bytes, act: HintAction, until: float,
               timed: HintOutcome) -> HintOutcome:
        """A hint on a RESERVED entry (its writer's Commit is pending) or a PROMOTING one (its read in flight):
        kept and applied when it commits or lands.

        Why: the connector saves a request's last blocks in the background and sends the request's hints when
        vLLM finishes it, so the hints of an agent's turn (Retain over the tool wait, Pin) often reach the
        daemon before the Commit of the very blocks they name; and an agent's Retain right after its Prefetch
        meets the promotions that Prefetch started. PREFETCH needs nothing (it will be in RAM)."""
        if act is HintAction.PREFETCH:
            return ACCEPTED
        if act is HintAction.DEMOTE and self._disk.store is None:
            return REJECTED
        _, _, acts = self._waiting.setdefault(eid, (key, ns, {}))
        acts.pop(act, None)  # the latest of each action, in the order they came (a Retain after a Release wins)
        acts[act] = (until, timed)
        return DEFERRED

    def committed(self, eids: Sequence[int]) -> None:
        """These entries just committed (or their promotion landed): apply the hints that waited for them. The
        key and namespace are checked again: hints apply only to the block they were sent for, should an id
        whose slot went without `forget` (a cancelled promotion) be reused."""
        if not self._waiting:
            return
        cat = self._cat
        for eid in eids:
            waiting = self._waiting.pop(eid, None)
            if waiting is None:
                continue
            key, ns, acts = waiting
            if cat.keys[eid] != key or int(cat.ns[eid]) != ns.id:
                continue
            for act, (until, timed) in acts.items():
                res = self._act(ns, eid, key, act, until, timed)
                if res is REJECTED:  # the answer was DEFERRED: count what became of it
                    self._counters.hints_late_rejected += 1

    def _promoted(self, eid: int, landed: bool) -> None:
        """DiskLink: a promotion ended; its entry joined RAM (apply the hints that waited) or its slot goes."""
        if landed:
            self.committed([eid])
        else:
            self.forget(eid)

    def forget(self, eid: int) -> None:
        """The entry's slot went without a Commit or a landing (an aborted or expired reservation, a failed
        promotion): its waiting hints go with it."""
        if self._waiting:
            self._waiting.pop(eid, None)

    def waiting(self) -> int:
        """Entries with hints waiting for their Commit."""
        return len(self._waiting)

    @staticmethod
    def _not_in_ram(act: HintAction) -> HintOutcome:
        """A key only on disk: Release and Demote have nothing left to do; Retain and Pin nothing to keep."""
        if act in (HintAction.RELEASE, HintAction.DEMOTE):
            return ACCEPTED
        return REJECTED  # Retain, Pin: nothing in RAM to keep (prefetch first)

    # -- demote -----------------------------------------------------------------------------------------
    def _demote(self, eid: int, key: bytes) -> HintOutcome:
        if self._disk.store is None:
            return REJECTED
        cat = self._cat
        if cat.pins[eid]:
            return REJECTED  # pinned blocks stay in RAM: unpin first
        if cat.flags[eid] & ON_DISK:
            if cat.leases[eid]:
                self._policy.set_priority(eid, RELEASED)  # a reader holds it: first to go once released
                return DEFERRED
            self._drop(eid)
            return ACCEPTED
        if cat.flags[eid] & EVICTING:
            return DEFERRED  # being written back already: its slot goes when the write lands
        if self._disk.write_mode == "evict":  # written now, as an eviction's write-back
            self._disk.keep_again(eid)
            if not self._ram.demote(eid):
                return REJECTED  # the write queue is full (or the tier degraded)
            self._ram.apply_touches()
            self._policy.on_remove(eid)
            return DEFERRED
        if not cat.flags[eid] & (QUEUED | WRITING):
            self._disk.keep_again(eid)
            self._disk.queue_writes(np.array([eid], dtype=np.int64), bypass=True)
            if not cat.flags[eid] & QUEUED:
                return REJECTED  # the write-behind queue is full
        self._demoting[eid] = key
        return DEFERRED

    def _drop(self, eid: int) -> None:
        """Drop the RAM copy of a block with a disk copy (an eviction the hint asked for)."""
        self._policy.on_remove(eid)
        self._ram.evict(eid)

    def _written(self, eids: Sequence[int]) -> None:
        """DiskLink: these entries' disk writes ended (landed or failed); drop the RAM copies a Demote waits for."""
        if not self._demoting:
            return
        cat = self._cat
        for eid in eids:
            key = self._demoting.pop(eid, None)
            if (key is not None and cat.keys[eid] == key and cat.state[eid] == _COMMITTED
                    and cat.flags[eid] & ON_DISK and cat.leases[eid] == 0 and cat.pins[eid] == 0):
                self._ram.apply_touches()
                self._drop(eid)

    # -- pin --------------------------------------------------------------------------------------------
    def _pin(self, ns: Namespace, eid: int, key: bytes, until: float, timed: HintOutcome) -> HintOutcome:
        cat = self._cat
        held = self._pins.get(eid)
        if held is not None and held.key == key and held.ns_id == ns.id:
            held.until = max(held.until, until)
            heapq.heappush(self._pin_heap, (held.until, eid))
            return timed
        if held is not None:  # the id was reused since: that pin's block is gone, and so are its bytes
            self._pinned[held.tenant] -= held.size
            del self._pins[eid]
        size = int(cat.size[eid])
        used = self._pinned.get(ns.tenant, 0)
        if used + size > self._pin_budget(ns.tenant) or cat.pins[eid] >= 0xFFFF:
            return REJECTED
        cat.pins[eid] += 1
        self._pinned[ns.tenant] = used + size
        self._pins[eid] = _Pin(key, ns.id, ns.tenant, size, until)
        heapq.heappush(self._pin_heap, (until, eid))
        return timed

    def _pin_budget(self, tenant: str) -> int:
        if self._quotas is not None:
            return self._quotas.quota(tenant)
        return self._ram.allocator.capacity // 2

    def pinned_bytes(self, tenant: str = "") -> int:
        """Bytes the tenant's hint pins hold now."""
        return self._pinned.get(tenant, 0)

    def pins_left(self, now: float) -> list[tuple[int, float]]:
        """(entry id, seconds left) of every hint pin on the block it was given for (a hand-over carries them)."""
        cat = self._cat
        return [(eid, max(0.0, p.until - now)) for eid, p in self._pins.items()
                if cat.keys[eid] == p.key and int(cat.ns[eid]) == p.ns_id and cat.pins[eid] > 0]

    def restore_pin(self, ns: Namespace, eid: int, seconds_left: float, now: float) -> bool:
        """A predecessor's hint pin on a committed entry placed here: pinned again until the same deadline,
        counted in its tenant's pinned budget (False when that budget is spent)."""
        key = self._cat.keys[eid]
        if key is None:
            return False
        return self._pin(ns, eid, key, now + seconds_left, ACCEPTED) is not REJECTED

    def expire(self, now: float) -> int:
        """Undo the hint pins whose ttl has passed; how many."""
        heap, cat, n = self._pin_heap, self._cat, 0
        while heap and heap[0][0] <= now:
            until, eid = heapq.heappop(heap)
            pin = self._pins.get(eid)
            if pin is None or pin.until != until:
                continue  # extended since, or already gone
            del self._pins[eid]
            self._pinned[pin.tenant] -= pin.size
            if cat.keys[eid] == pin.key and int(cat.ns[eid]) == pin.ns_id and cat.pins[eid] > 0:
                cat.pins[eid] -= 1
            n += 1
        return n
