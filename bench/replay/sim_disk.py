"""The daemon's disk tier in the simulator (`SegmentLog`: kvstore/tiers/disk/segments.py, writer.py, reclaim.py).

- space: each record takes round_up(block, 4 KiB) in the active segment; a full segment is sealed and a free
  one (or, when none is left, a sealed one: below) becomes active; a batch never reclaims a segment it wrote
  into itself (NO_SPACE: tiers.py sizes segments so that this cannot happen).
- which sealed one (kvstore/tiers/disk/cleaning.py): the one with the fewest unbacked records (live ones whose
  block RAM does not hold backed by them: `resident`), oldest first among equals, when those fill at most
  CLEAN_SHARE (a third) of it and it is not the oldest: it is CLEANED (every unbacked record copied to its start,
  in write order, the backed ones dropped). Otherwise the oldest, with its second chance (below).
- writes come in the writer's batches of 16 (`write`), in the order they were queued.
- second chance (`reinsert_hits`): every promotion is a verified read of the block's record. When a segment
  is reclaimed, its records read at least `reinsert_hits` times since their (re)write are copied first, in
  write order, to the start of that same segment, which becomes the active one: at most half a segment of
  them (REINSERT_SHARE); their read counts start again at 0. The others leave the tier (`dropped`).
  reinsert_hits 0: plain FIFO by segment. Under disk_write = evict the store says which records back a block
  RAM holds (`resident`: a promoted block): those get no second chance (kvstore/tiers/disk/reclaim.py).
- a delete (`remove`: a Release hint lets go of a disk copy) takes the record out of the index; its bytes stay
  dead in their segment until it is reclaimed, or until every record of that segment is gone: then it is
  reused before any reclamation (segments.take_dead), oldest first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from kvstore.tiers.disk.cleaning import CLEAN_SHARE

__all__ = ["SegmentLog", "WRITER_BATCH_BLOCKS", "PAGE_BYTES", "REINSERT_SHARE"]

WRITER_BATCH_BLOCKS = 16  # kvstore.engine.movement.Mover: blocks one write_many call takes from the queue
PAGE_BYTES = 4096  # every disk record starts on a page and is rounded up to whole pages
REINSERT_SHARE = 0.5  # kvstore.tiers.disk.reclaim: most of a reclaimed segment its kept records may fill


class SegmentLog:
    """The daemon's disk tier: a log of `segments` segments of `segment_bytes`, reclaimed oldest first, keeping
    the records read at least `reinsert_hits` times since their write (0: plain FIFO)."""

    def __init__(self, name: str, segments: int, segment_bytes: int, block_bytes: int,
                 batch_blocks: int = WRITER_BATCH_BLOCKS, reinsert_hits: int = 1) -> None:
        self.record_bytes = -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
        if segments < 2 or self.record_bytes > segment_bytes:
            raise ValueError(f"tier {name}: need >= 2 segments that each hold a {self.record_bytes}-byte record")
        self.name = name
        self.segments, self.segment_bytes, self.batch_blocks = segments, segment_bytes, batch_blocks
        self.reinsert_hits = reinsert_hits
        self.keep_max = int(segment_bytes * REINSERT_SHARE) // self.record_bytes  # kept records per reclamation
        self.capacity_blocks: int | None = segments * (segment_bytes // self.record_bytes)
        self._where: dict[bytes, int] = {}  # key -> the segment use holding it
        self._members: dict[int, list[bytes]] = {}  # segment use -> live keys written into it, in offset order
        self._reads: dict[bytes, int] = {}  # key -> verified reads of its record since it was (re)written
        self._sealed: deque[int] = deque()  # oldest first
        self._active: int | None = None
        self._wp = 0
        self._free = segments
        self._uses = 0
        self.resident: Callable[[bytes], bool] | None = None  # disk_write = evict: RAM holds it, backed by it
        self.dropped: list[bytes] = []  # keys reclamation dropped since the caller last emptied this list
        self.written = self.reclaimed = self.reinserted = self.no_space = self.cleaned = 0

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def read(self, key: bytes) -> None:
        """A verified read of the key's record (a promotion)."""
        self._reads[key] = self._reads.get(key, 0) + 1

    def remove(self, key: bytes) -> None:
        """A delete: the record leaves the index, its bytes stay dead until its segment is reclaimed."""
        use = self._where.pop(key, None)
        if use is not None:
            self._members[use].remove(key)
            self._reads.pop(key, None)

    def write(self, keys: Sequence[bytes]) -> list[bool]:
        """Append records in order, batch by batch (writer.py's _reserve); whether each was written."""
        out: list[bool] = []
        for start in range(0, len(keys), self.batch_blocks):
            touched: set[int] = set()
            for k in keys[start:start + self.batch_blocks]:
                ok = self._place(k, touched)
                out.append(ok)
                self.written += ok
                self.no_space += not ok
        return out

    def _place(self, key: bytes, touched: set[int]) -> bool:
        while self._active is None or self._wp + self.record_bytes > self.segment_bytes:
            if self._active is not None:
                self._sealed.append(self._active)  # seal the full one
                self._active = None
            keep: list[bytes] = []
            dead = next((u for u in self._sealed if not self._members[u] and u not in touched), None)
            if self._free:
                self._free -= 1
            elif dead is not None:  # every record deleted (segments.take_dead): reused with nothing dropped
                self._sealed.remove(dead)
                del self._members[dead]
            elif (clean := self._cleanest(touched)) is not None:
                self._sealed.remove(clean)
                keep = self._clean(clean)
            elif self._sealed and self._sealed[0] not in touched:
                keep = self._reclaim(self._sealed.popleft())
            else:
                return False  # this batch alone fills the tier: NO_SPACE
            self._uses += 1
            self._active, self._wp = self._uses, 0
            self._members[self._active] = []
            for k in keep:  # copied to the start of the reclaimed segment, now the active one
                self._append(k)
                self.reinserted += 1
            if keep:
                touched.add(self._active)
        old = self._where.get(key)
        if old is not None:  # a rewrite replaces the older record (not reached by the replay's puts)
            self._members[old].remove(key)
        self._append(key)
        touched.add(self._active)
        return True

    def _append(self, key: bytes) -> None:
        self._where[key] = self._active  # type: ignore[assignment]  # _append runs with a segment active
        self._members[self._active].append(key)  # type: ignore[index]  # _append runs with a segment active
        self._wp += self.record_bytes
        self._reads.pop(key, None)

    def _unbacked(self, use: int) -> int:
        resident = self.resident
        members = self._members[use]
        return len(members) if resident is None else sum(1 for k in members if not resident(k))

    def _cleanest(self, touched: set[int]) -> int | None:
        """The sealed segment to clean (cleaning.cleanest), or None: reclaim the oldest."""
        candidates = [(self._unbacked(use), age, use) for age, use in enumerate(self._sealed) if use not in touched]
        if not candidates:
            return None
        unbacked, age, use = min(candidates)   # the fewest unbacked records, the oldest among equals
        if unbacked * self.record_bytes > self.segment_bytes * CLEAN_SHARE or age == 0:
            return None
        return use

    def _clean(self, use: int) -> list[bytes]:
        """Take a younger segment use back: its unbacked records to keep (write order), the backed ones leave."""
        self.cleaned += 1
        resident = self.resident
        return self._take_back(use, lambda k, kept: resident is None or not resident(k))

    def _reclaim(self, use: int) -> list[bytes]:
        """Take the oldest segment use back: the records read since written that RAM does not back, within half
        a segment, are kept (write order); the others leave the tier."""
        resident = self.resident
        return self._take_back(use, lambda k, kept: bool(
            self.reinsert_hits and self._reads.get(k, 0) >= self.reinsert_hits and kept < self.keep_max
            and (resident is None or not resident(k))))

    def _take_back(self, use: int, keeps: Callable[[bytes, int], bool]) -> list[bytes]:
        """Empty segment use `use`: the records `keeps(key, kept so far)` says to keep, in write order; the others
        leave the tier (dropped)."""
        keep: list[bytes] = []
        for k in self._members.pop(use):
            if keeps(k, len(keep)):
                keep.append(k)
                continue
            del self._where[k]
            self._reads.pop(k, None)
            self.dropped.append(k)
            self.reclaimed += 1
        return keep
