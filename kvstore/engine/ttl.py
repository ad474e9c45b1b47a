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

    def values(self) -> list[T]:
        return list(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items
