"""Ids with a deadline: read leases and write reservations.

Every item in one table has the same TTL, so deadlines grow with insertion order and a FIFO of
(deadline, id) finds the expired items in O(expired) without a heap. Items removed early (released,
committed) are simply absent from the dict when the FIFO reaches them.

Ids start at a random 48-bit base so that an id from before a daemon restart is unknown to the new daemon
instead of silently naming someone else's lease.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["TtlTable"]

T = TypeVar("T")


class TtlTable(Generic[T]):
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: dict[int, T] = {}
        self._order: deque[tuple[float, int]] = deque()
        self._next_id = random.getrandbits(48) + 1

    def add(self, payload: T) -> int:
        item_id = self._next_id
        self._next_id += 1
        self._items[item_id] = payload
        self._order.append((self._clock() + self.ttl_s, item_id))
        return item_id

    def pop(self, item_id: int) -> T | None:
        """Remove and return an item, or None when it is unknown or already gone."""
        return self._items.pop(item_id, None)

    def get(self, item_id: int) -> T | None:
        return self._items.get(item_id)

    def expire(self, now: float | None = None) -> list[tuple[int, T]]:
        """Remove and return every item whose deadline has passed."""
        now = self._clock() if now is None else now
        out: list[tuple[int, T]] = []
        order, items = self._order, self._items
        while order and order[0][0] <= now:
            _, item_id = order.popleft()
            payload = items.pop(item_id, None)
            if payload is not None:
                out.append((item_id, payload))
        return out

    def live(self, now: float | None = None) -> list[tuple[int, T, float]]:
        """(id, payload, seconds left) of every item, soonest deadline first (a hand-over carries them)."""
        now = self._clock() if now is None else now
        return [(i, self._items[i], max(0.0, d - now)) for d, i in self._order if i in self._items]

    @property
    def next_id(self) -> int:
        return self._next_id

    @next_id.setter
    def next_id(self, value: int) -> None:
        """Ids from here on start at `value` at least (a successor continues its predecessor's ids)."""
        self._next_id = max(self._next_id, value)

    def restore(self, item_id: int, payload: T, seconds_left: float, next_id: int = 0) -> None:
        """An item of a previous daemon under its own id, expiring `seconds_left` from now; later ids start past
        both it and `next_id` (so no id of the two daemons ever names two items). Call in deadline order."""
        self._items[item_id] = payload
        self._order.append((self._clock() + max(0.0, seconds_left), item_id))
        self._next_id = max(self._next_id, item_id + 1, next_id)

    def values(self) -> list[T]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items
