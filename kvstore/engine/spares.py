"""Spare slots: arena slots a same-node client holds ahead of its puts, so that a put is a copy and one request.

Why: a put through the arena took two round trips, a Reserve for the slots and a Commit after the copy, and on
one node each costs more than copying a 256 KiB block. A fast-path connection asks for spare slots of a block
size (Engine.spare, which replaces any it held: a connection keeps slots of one size, the one it puts now); a
put copies each block into one and sends Store (namespace, keys, sizes, the slots): the daemon binds each key to
its slot and commits it in one step (writes.py), and hands back a new spare slot for each one used, so the next
put of that size is again one request.

Rules, checked under the engine's lock before anything changes (a refused Store changes nothing):
- a slot belongs to the connection it was given to (its owner id); naming another's slot is refused;
- a slot holds a block whose size maps to the slot's size class (allocator.slot_bytes);
- with isolate_tenants a slot lives in its tenant's memory file: only that tenant's namespaces may bind it;
- a key already present, or being written by someone else, leaves its slot spare (the client may use it again);
- a grant is all or nothing: at most MAX_PER_OWNER slots per connection, spare slots take at most
  1/SHARE_DIVISOR of the arena, and the slots must be found (evicting as a Reserve does); else none are granted
  and the client puts the two-round-trip way;
- the slots a connection held are freed at once when it asks for new ones: its one thread is waiting for that
  answer, so it copies into none of them;
- when the connection closes its slots go to a quarantine for quarantine_s (a thread of that client may still
  be copying into one), then are freed (the generation bumped, as on every free).

Spare slots are allocated arena bytes that no entry owns: counted by the watermarks, never evicted, never
visible to a reader. So they shrink the cache by what they hold (a slot, and a slab per size class in use): a
Reserve of the whole arena fails while connections hold some, and an exact replay of an eviction policy runs
with them off (Client(spare_slots=False)). Called under the engine's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from operator import itemgetter

from kvstore.engine.config import EngineConfig
from kvstore.engine.ram_space import RamSpace
from kvstore.errors import InvalidRequestError

__all__ = ["SpareSlots", "MAX_PER_OWNER", "SHARE_DIVISOR"]

MAX_PER_OWNER = 64   # a put_many batch of 64 blocks needs no second request; 64 x 2 MiB = 128 MiB at most
SHARE_DIVISOR = 8    # spare slots never take more than 1/8 of the arena, whatever the number of connections


class SpareSlots:
    """owner (a fast-path connection) -> its spare slots: offset -> (slot bytes, allocation domain)."""

    def __init__(self, config: EngineConfig, ram: RamSpace) -> None:
        self._config = config
        self._ram = ram
        self._owned: dict[int, dict[int, tuple[int, str]]] = {}
        self._quarantine: deque[tuple[float, int, int]] = deque()  # (free at, offset, slot bytes)
        self.bytes = 0      # spare and quarantined slot bytes
        self.slots = 0      # spare slots held by connections now

    def _domain(self, tenant: str) -> str:
        return self._ram.domain(tenant)

    def replace(self, owner: int, size: int, count: int, tenant: str) -> tuple[int, list[int]]:
        """Free the owner's spare slots (its thread waits for this answer: it copies into none of them), then
        grant `count` new ones for blocks of `size` bytes: (their slot bytes, their offsets), or no offsets at the
        limits or when the slots cannot be found (never StoreFullError: the caller's put goes the Reserve way and
        gets that answer there)."""
        for off, (cls, _) in self._owned.pop(owner, {}).items():
            self._ram.free_slot(off)
            self.bytes -= cls
            self.slots -= 1
        return self.grant(owner, size, count, tenant)

    def grant(self, owner: int, size: int, count: int, tenant: str, keep: Collection[int] = ()) -> tuple[int, list[int]]:
        """`count` more spare slots of `size` for `owner`, all or none (see `replace`). `keep`: entries not to
        evict for them (the blocks a Store just stored)."""
        cls = self._ram.slot_bytes(size)
        owned = self._owned.setdefault(owner, {})
        if len(owned) + count > MAX_PER_OWNER or self.bytes + count * cls > self._ram.allocator.capacity // SHARE_DIVISOR:
            return cls, []
        keep_set = keep if isinstance(keep, set) else set(keep)
        out = self._ram.allocate_many(size, count, keep_set, tenant)
        if out is None:
            return cls, []
        owned.update(dict.fromkeys(out, (cls, self._domain(tenant))))
        self.bytes += count * cls
        self.slots += count
        return cls, out

    def check(self, owner: int, offsets: Sequence[int], sizes: Sequence[int], tenant: str) -> None:
        """InvalidRequestError unless every offset is a distinct spare slot of `owner`, of the size class of its
        block, in the memory file of the namespace's tenant."""
        if len(offsets) != len(sizes):
            raise InvalidRequestError(f"{len(offsets)} slots for {len(sizes)} blocks: name one spare slot per block")
        if len(set(offsets)) != len(offsets):
            raise InvalidRequestError("the same spare slot named twice in one Store")
        owned = self._owned.get(owner, {})
        domain = self._domain(tenant)
        if sizes and sizes.count(sizes[0]) == len(sizes):  # one size (the usual put): C-level passes only
            if list(map(owned.get, offsets)).count((self._ram.slot_bytes(sizes[0]), domain)) == len(offsets):
                return
        classes: dict[int, int] = {}  # size -> slot bytes: a Store's blocks mostly share one size
        for off, size in zip(offsets, sizes):
            slot = owned.get(off)
            if slot is None:
                raise InvalidRequestError(f"offset {off} is not a spare slot of this connection: ask for spare slots "
                                          "(they belong to the connection they were given to)")
            cls = classes.get(size)
            if cls is None:
                cls = classes[size] = self._ram.slot_bytes(size)
            if cls != slot[0]:
                raise InvalidRequestError(f"a block of {size} bytes does not fit the size class of spare slot {off} "
                                          f"({slot[0]} bytes): use a slot granted for this block size")
            if slot[1] != domain:
                raise InvalidRequestError(f"spare slot {off} lives in another tenant's memory than this namespace")

    def take(self, owner: int, offsets: Sequence[int]) -> None:
        """Slots that now hold committed entries: no longer spare (the entries free them as usual)."""
        owned = self._owned[owner]
        self.bytes -= sum(map(itemgetter(0), map(owned.pop, offsets)))
        self.slots -= len(offsets)

    def drop(self, owner: int, now: float) -> int:
        """The owner's connection closed: its slots wait out the quarantine, then are freed; how many."""
        owned = self._owned.pop(owner, {})
        for off, (cls, _) in owned.items():
            self._quarantine.append((now + self._config.quarantine_s, off, cls))
        self.slots -= len(owned)
        return len(owned)

    def expire(self, now: float) -> None:
        """Free quarantined slots past their grace."""
        while self._quarantine and self._quarantine[0][0] <= now:
            _, off, cls = self._quarantine.popleft()
            self._ram.free_slot(off)
            self.bytes -= cls

    def held(self, now: float) -> list[tuple[int, int, float]]:
        """(offset, slot bytes, seconds until freed) of every spare and quarantined slot: what a hand-over gives
        its successor to quarantine (a spare slot's connection does not survive the hand-over: full grace)."""
        out = [(off, cls, self._config.quarantine_s) for owned in self._owned.values() for off, (cls, _) in owned.items()]
        return out + [(off, cls, max(0.0, at - now)) for at, off, cls in self._quarantine]

    def hold(self, offset: int, slot_bytes: int, seconds_left: float, now: float) -> None:
        """Quarantine a slot already allocated here (a predecessor's spare or quarantined slot): freed later."""
        self._quarantine.append((now + seconds_left, offset, slot_bytes))
        self.bytes += slot_bytes

    def sort_quarantine(self) -> None:
        """After `hold`s: the quarantine is a deadline-ordered queue."""
        self._quarantine = deque(sorted(self._quarantine, key=itemgetter(0)))

    def status(self) -> dict[str, int]:
        """For the metrics: slots held by connections now, and their bytes with the quarantined ones'."""
        return {"spare_slots": self.slots, "spare_bytes": self.bytes}

    def owned(self, owner: int) -> dict[int, int]:
        """The owner's spare slots: offset -> slot bytes (for tests and inspection)."""
        return {off: cls for off, (cls, _) in self._owned.get(owner, {}).items()}
