"""CounterSet: a fixed set of named monotonic counters, the one implementation every layer's counters share.

Each layer declares its own set as a subclass that names its counters in `__slots__` (and nothing else), so a
misspelt name is an AttributeError in tests rather than a silently new counter, and reading or bumping a
counter costs what a plain attribute costs:

    class Counters(CounterSet):        # kvstore/engine/counters.py: bumped under the engine's lock
        __slots__ = COUNTER_NAMES
    class PeerCounters(CounterSet):    # kvstore/peer/counters.py: bumped from many threads
        __slots__ = tuple(COUNTER_HELP)
        LOCKED = True

LOCKED says who guards the values. False: the owner's lock (the engine's), and callers may write
`counters.evictions += 1` directly. True: the set's own lock, taken by add(), get() and snapshot(); callers
then go through add() only, since `+=` on an attribute is not atomic across threads.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, ClassVar

__all__ = ["CounterSet"]


class CounterSet:
    __slots__ = ("_lock",)
    NAMES: ClassVar[tuple[str, ...]] = ()  # the subclass's __slots__, in order: snapshot()'s keys
    LOCKED: ClassVar[bool] = False

    if TYPE_CHECKING:
        # The names live in each subclass's __slots__, a tuple built at import that mypy cannot read. The runtime
        # keeps the typo check (slots: AttributeError); the checker is told every counter is an int attribute.
        def __getattr__(self, name: str) -> int: ...
        def __setattr__(self, name: str, value: object) -> None: ...

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        slots = cls.__dict__.get("__slots__", ())
        cls.NAMES = cls.NAMES + ((slots,) if isinstance(slots, str) else tuple(slots))

    def __init__(self) -> None:
        self._lock = threading.Lock() if self.LOCKED else None
        for name in self.NAMES:
            setattr(self, name, 0)

    def add(self, name: str, n: int = 1) -> None:
        """Bump counter `name` by n (an AttributeError for a name not in the set, even when n is 0)."""
        if self._lock is None:
            setattr(self, name, getattr(self, name) + n)
            return
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def get(self, name: str) -> int:
        if self._lock is None:
            return getattr(self, name)
        with self._lock:
            return getattr(self, name)

    def snapshot(self) -> dict[str, int]:
        """Every counter by name, read at one moment (under the set's lock when it has one)."""
        if self._lock is None:
            return {name: getattr(self, name) for name in self.NAMES}
        with self._lock:
            return {name: getattr(self, name) for name in self.NAMES}
