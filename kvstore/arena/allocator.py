"""O(1) slot allocation in the arena: slabs carved into size classes (the memcached/CacheLib shape).

The data region is cut into equal slabs (`slab_bytes`, which is also the largest block). A slab is free or
belongs to one size class and holds `slab_bytes // slot_bytes` slots. Size classes go 4 KiB * 2^k times
1, 1.25, 1.5, 1.75, rounded up to whole pages, so above 16 KiB a slot wastes under 20 % of itself (below it,
page rounding dominates: 4097 bytes take 8 KiB) and exact powers of two (the usual KV block) waste nothing.
Every slot is page-aligned, so the same memory can be DMA-registered and used for O_DIRECT I/O.

Allocation pops a slot from any partly used slab of the class, else claims a free slab: O(1). The partly used
slabs are a dict used as an ordered set and taken with `popitem`, never `next(iter(...))`: iterating a dict
from its front walks over the holes its deleted keys leave, which made allocation O(partial slabs). A slab
whose last slot is freed returns to the free pool, so a class that stops being used gives its memory back
(no slab calcification). Slots of a fresh slab are handed out by a bump index, so only freed slots cost an
entry in the slab's free set (a dict, so that a double free is caught in O(1)).

Domains (backing.py): every slab is bound to one domain's memory file, and a slot is only ever handed to
an allocation of its slab's domain. Partly used slabs are kept per (domain, class). An empty slab stays bound
to its domain and is reused by that domain first; when a domain has no empty slab of its own it takes one
from the shared pool ("") or, failing that, from the domain with the most empty slabs, and `bind` (the
backing's) moves the slab's memory over. Without tokens there is only the "" domain and nothing ever moves.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError, KVStoreError

__all__ = ["SlabAllocator", "size_classes", "ClassUsage"]

PAGE = 4096
_SIZE_MEMO = 1024  # distinct block sizes whose class is remembered
log = logging.getLogger(__name__)


def size_classes(max_bytes: int) -> list[int]:
    """Ascending slot sizes from one page up to and including `max_bytes`."""
    out: set[int] = set()
    base = PAGE
    while base <= max_bytes:
        for num in (4, 5, 6, 7):
            size = base * num // 4
            size = -(-size // PAGE) * PAGE
            if size <= max_bytes:
                out.add(size)
        base *= 2
    out.add(max_bytes)
    return sorted(out)


@dataclass(frozen=True)
class ClassUsage:
    slot_bytes: int
    slabs: int
    used_slots: int
    free_slots: int


class _Slab:
    __slots__ = ("cls", "used", "bump", "free", "domain")

    def __init__(self) -> None:
        self.domain = ""
        self.cls = -1
        self.used = 0
        self.bump = 0
        self.free: dict[int, None] = {}


class SlabAllocator:
    """Hands out page-aligned slots at absolute offsets inside [base, base + capacity)."""

    def __init__(self, base: int, capacity: int, slab_bytes: int,
                 bind: Callable[[int, str, str], None] | None = None) -> None:
        """`bind(slab, old_domain, new_domain)` moves an empty slab's memory (ArenaBacking.bind); None when
        there is nothing to move (one domain, or tests)."""
        if slab_bytes % PAGE or slab_bytes <= 0:
            raise ConfigError(f"slab_bytes={slab_bytes} must be a positive multiple of {PAGE}")
        if base % PAGE:
            raise ConfigError(f"arena data offset {base} is not page-aligned")
        n_slabs = capacity // slab_bytes
        if n_slabs < 2:
            raise ConfigError(
                f"arena of {capacity} bytes holds {n_slabs} slab(s) of {slab_bytes}: "
                "make arena_bytes at least 2 x max_block_bytes (8 x is better)"
            )
        self.base = base
        self.slab_bytes = slab_bytes
        self.classes = size_classes(slab_bytes)
        self._slots_per_slab = [slab_bytes // c for c in self.classes]
        self._slabs = [_Slab() for _ in range(n_slabs)]
        self._free: dict[str, list[int]] = {"": list(range(n_slabs - 1, -1, -1))}  # pop(): low offsets first
        self._partial: dict[tuple[str, int], dict[int, None]] = {}
        self._bind = bind
        self.binds = 0          # empty slabs moved to another domain
        self.bind_failures = 0
        # size -> class index, filled as sizes are seen: a put names a handful of block sizes, and each of its
        # blocks asks for its class two or three times (allocate, the spare-slot checks, the eviction's count)
        self._class_by_size: dict[int, int] = {}
        self._class_slabs = [0] * len(self.classes)
        self._class_used = [0] * len(self.classes)
        self.allocated_bytes = 0

    @property
    def n_slabs(self) -> int:
        return len(self._slabs)

    @property
    def capacity(self) -> int:
        return len(self._slabs) * self.slab_bytes

    @property
    def free_slabs(self) -> int:
        return sum(len(v) for v in self._free.values())

    def slab_domain(self, idx: int) -> str:
        return self._slabs[idx].domain

    def domain_slabs(self) -> dict[str, int]:
        """Slabs bound to each domain (used or empty)."""
        out: dict[str, int] = {}
        for slab in self._slabs:
            out[slab.domain] = out.get(slab.domain, 0) + 1
        return out

    def class_of(self, size: int) -> int:
        """Index of the smallest class that fits `size` bytes (caller has checked size <= slab_bytes)."""
        cls = self._class_by_size.get(size)
        if cls is None:
            cls = bisect.bisect_left(self.classes, size)
            if len(self._class_by_size) < _SIZE_MEMO:  # bounded: a client naming every size cannot grow it
                self._class_by_size[size] = cls
        return cls

    def slot_bytes(self, size: int) -> int:
        return self.classes[self.class_of(size)]

    def allocate_many(self, size: int, count: int, domain: str = "") -> list[int]:
        """Up to `count` slots for `size` bytes, the ones `allocate` of each would give, in that order, until
        none is left: fewer when the arena has no more free (the caller evicts and asks for the rest). Each
        slab is filled as far as it goes before the next is taken, with its lookups done once."""
        cls = self.class_of(size)
        slot_bytes, per_slab, key = self.classes[cls], self._slots_per_slab[cls], (domain, cls)
        partial = self._partial.get(key)
        out: list[int] = []
        while len(out) < count:
            if partial:
                idx = partial.popitem()[0]
                slab = self._slabs[idx]
            else:
                got = self._claim(domain)
                if got is None:
                    break
                idx, slab = got, self._slabs[got]
                slab.cls, slab.used, slab.bump = cls, 0, 0
                self._class_slabs[cls] += 1
                partial = self._partial.setdefault(key, {})
            start = self.base + idx * self.slab_bytes
            while len(out) < count and slab.used < per_slab:
                if slab.free:
                    slot = slab.free.popitem()[0]
                else:
                    slot = slab.bump
                    slab.bump += 1
                slab.used += 1
                out.append(start + slot * slot_bytes)
            if slab.used < per_slab:
                partial[idx] = None
        self._class_used[cls] += len(out)
        self.allocated_bytes += len(out) * slot_bytes
        return out

    def allocate(self, size: int, domain: str = "") -> int | None:
        """Offset of a free slot for `size` bytes in a slab of `domain`, or None when neither a slot nor an
        empty slab is left (or the empty slab's memory could not be moved to `domain`)."""
        got = self.allocate_many(size, 1, domain)
        return got[0] if got else None

    def _claim(self, domain: str) -> int | None:
        """An empty slab for `domain`: one of its own, else one moved from the pool or the richest domain."""
        own = self._free.get(domain)
        if own:
            return own.pop()
        pool = self._free.get("")
        donor = "" if pool else max((d for d, v in self._free.items() if v), key=lambda d: len(self._free[d]),
                                    default=None)
        if donor is None:
            return None
        idx = self._free[donor].pop()
        if self._bind is not None:
            try:
                self._bind(idx, donor, domain)
            except (OSError, KVStoreError) as exc:
                self._free[donor].append(idx)
                self.bind_failures += 1
                log.warning("cannot move arena slab %d to domain %r: %s", idx, domain, exc)
                return None
        self._slabs[idx].domain = domain
        self.binds += 1
        return idx

    def restore(self, domains: Sequence[str], slots: Sequence[tuple[int, int]]) -> list[int]:
        """On a fresh allocator: bind slab i to `domains[i]` and mark each (offset, block size) of `slots`
        allocated, as a previous daemon's arena holds them (a hand-over restart: engine/adoption.py). A slot that
        does not fit (outside the data region, off its class's grid, in a slab of another class, named twice)
        is refused: returns the indexes of those (their blocks are dropped, never served). O(slots + slabs)."""
        if self.allocated_bytes or self.binds:
            raise ValueError("restore needs a fresh allocator")
        n, classes, per_slab_of = len(self._slabs), self.classes, self._slots_per_slab
        taken: dict[int, tuple[int, set[int]]] = {}
        refused: list[int] = []
        for i, (offset, size) in enumerate(slots):
            idx, within = divmod(offset - self.base, self.slab_bytes)
            if not 0 <= idx < n or not 0 < size <= self.slab_bytes:
                refused.append(i)
                continue
            cls = self.class_of(size)
            slot, rem = divmod(within, classes[cls])
            got = taken.setdefault(idx, (cls, set()))
            if rem or slot >= per_slab_of[cls] or got[0] != cls or slot in got[1]:
                refused.append(i)
                continue
            got[1].add(slot)
        self._free, self._partial = {}, {}
        for idx in range(n - 1, -1, -1):  # pop() takes from the end: low offsets first, as at start
            slab = self._slabs[idx]
            slab.domain = domains[idx]
            cls, used = taken.get(idx, (-1, set()))
            if not used:
                self._free.setdefault(slab.domain, []).append(idx)
                continue
            slab.cls, slab.used, slab.bump = cls, len(used), max(used) + 1
            slab.free = {s: None for s in range(slab.bump) if s not in used}
            self._class_slabs[cls] += 1
            self._class_used[cls] += len(used)
            self.allocated_bytes += len(used) * classes[cls]
            if slab.used < per_slab_of[cls]:
                self._partial.setdefault((slab.domain, cls), {})[idx] = None
        return refused

    def free(self, offset: int) -> None:
        self.free_many((offset,))

    def free_many(self, offsets: Iterable[int]) -> None:
        """Give back each slot (ValueError at the first that is not an allocated slot; those before it are
        freed). One call for an eviction's victims: the per-slot work with its lookups bound once."""
        base, slab_bytes, slabs, classes = self.base, self.slab_bytes, self._slabs, self.classes
        n_slabs, per_slab_of, class_used = len(slabs), self._slots_per_slab, self._class_used
        for offset in offsets:
            idx, within = divmod(offset - base, slab_bytes)
            # Range-check idx: a negative one would silently index the slabs from the end.
            slab = slabs[idx] if 0 <= idx < n_slabs else None
            if slab is None or slab.cls < 0:
                raise ValueError(f"free of offset {offset} that is not an allocated slot")
            cls = slab.cls
            slot_size = classes[cls]
            slot, rem = divmod(within, slot_size)
            if rem or slot >= slab.bump or slot in slab.free:
                raise ValueError(f"free of offset {offset} that is not an allocated slot")
            was_full = slab.used == per_slab_of[cls]
            slab.used -= 1
            class_used[cls] -= 1
            self.allocated_bytes -= slot_size
            if slab.used == 0:
                self._partial.get((slab.domain, cls), {}).pop(idx, None)
                slab.cls, slab.bump, slab.free = -1, 0, {}
                self._class_slabs[cls] -= 1
                self._free.setdefault(slab.domain, []).append(idx)
                continue
            slab.free[slot] = None
            if was_full:
                self._partial.setdefault((slab.domain, cls), {})[idx] = None

    def assigned_bytes(self) -> int:
        """Bytes of slabs that belong to some class (the denominator of fragmentation)."""
        return (len(self._slabs) - self.free_slabs) * self.slab_bytes

    def usage(self) -> list[ClassUsage]:
        """Per-class slabs and slots, only for classes that hold at least one slab."""
        out = []
        for cls, slot in enumerate(self.classes):
            slabs = self._class_slabs[cls]
            if slabs:
                used = self._class_used[cls]
                out.append(ClassUsage(slot, slabs, used, slabs * self._slots_per_slab[cls] - used))
        return out
