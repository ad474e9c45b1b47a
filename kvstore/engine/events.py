"""KV events for routers: which blocks this node holds, in which tier (the way llm-d and Dynamo index vLLM's).

The engine publishes under its own lock; publishing is an append to each subscriber's bounded buffer and
never waits. A subscriber that does not keep up loses the events that do not fit and is told so with a Gap
event carrying the count, so a slow consumer can never slow puts and gets. With no subscriber, publish
returns at once.

Lock order: engine lock -> bus lock (publish); a consumer takes only the bus lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Event", "EventBus", "Subscription", "STORED", "REMOVED", "MOVED", "GAP"]

STORED, REMOVED, MOVED, GAP = "stored", "removed", "moved", "gap"


@dataclass(frozen=True)
class Event:
    seq: int
    time: float
    kind: str                      # stored | removed | moved | gap
    namespace: str = ""
    keys: tuple[bytes, ...] = ()
    tier: int = 0                  # a kvstore.vocab.Tier; stored/removed: the tier; moved: the source tier
    to_tier: int = 0               # moved only (a Tier)
    whole_namespace: bool = False  # removed only
    dropped: int = 0               # gap only


class Subscription:
    """One subscriber's bounded buffer. Drops are recorded as a pending gap that takes the place of the lost
    events: it is queued before the next event that fits, or handed out when the buffer runs empty."""

    def __init__(self, bus: EventBus, namespaces: frozenset[str], capacity: int, internal: bool = False) -> None:
        self._bus = bus
        self.internal = internal  # the daemon's own consumer (the vLLM-format publisher), not a Subscribe stream
        self.namespaces = namespaces
        self.capacity = capacity
        self._queue: deque[Event] = deque()
        self._pending_gap = 0
        self.dropped_total = 0

    def _offer(self, event: Event) -> None:  # called with the bus lock held
        if self.namespaces and event.namespace not in self.namespaces:
            return
        if len(self._queue) + (1 if self._pending_gap else 0) >= self.capacity:
            self._pending_gap += 1
            self.dropped_total += 1
            self._bus.dropped_total += 1
            return
        if self._pending_gap:
            self._queue.append(self._gap())
        self._queue.append(event)

    def _gap(self) -> Event:
        gap = Event(0, time.time(), GAP, dropped=self._pending_gap)
        self._pending_gap = 0
        return gap

    def next(self, timeout_s: float) -> Event | None:
        """The next event (a Gap where events were dropped), or None after `timeout_s` without one."""
        with self._bus._cond:
            if not self._queue and not self._pending_gap:
                self._bus._cond.wait(timeout_s)
            if self._queue:
                return self._queue.popleft()
            if self._pending_gap:
                return self._gap()
            return None

    def close(self) -> None:
        self._bus.unsubscribe(self)


class EventBus:
    def __init__(self, default_capacity: int = 4096) -> None:
        self.default_capacity = default_capacity
        self._cond = threading.Condition()
        self._subs: list[Subscription] = []
        self._seq = 0
        self.dropped_total = 0  # events lost by any subscriber, ever (a metric)

    def subscribe(self, namespaces: Sequence[str] = (), capacity: int = 0, internal: bool = False) -> Subscription:
        """`internal`: the daemon's own consumer; not counted by `streams` (the Subscribe RPC's limit)."""
        sub = Subscription(self, frozenset(namespaces), capacity or self.default_capacity, internal)
        with self._cond:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._cond:
            if sub in self._subs:
                self._subs.remove(sub)

    @property
    def subscribers(self) -> int:
        """Every subscription: while there is none, publishers skip building their events."""
        return len(self._subs)

    @property
    def streams(self) -> int:
        """Subscriptions of Subscribe streams (the daemon's own consumers left out)."""
        return sum(1 for s in self._subs if not s.internal)

    def publish(self, kind: str, namespace: str, keys: Sequence[bytes], tier: int, to_tier: int = 0,
                whole_namespace: bool = False) -> None:
        if not self._subs or (not keys and not whole_namespace):
            return
        with self._cond:
            self._seq += 1
            event = Event(self._seq, time.time(), kind, namespace, tuple(keys), tier, to_tier, whole_namespace)
            for sub in self._subs:
                sub._offer(event)
            self._cond.notify_all()
