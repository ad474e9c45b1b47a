"""The engine's one lock, with room for work a call leaves for after its reply.

Why: a Store or Commit that fills the arena past its high watermark also evicts down to the low one: on a Store
of 16 blocks of 2 MiB, ~130 us of its ~320 us of Python in-process, more in the daemon, where the client's copy
has just flushed the caches. Nothing in the reply depends on that eviction (the new spare slots come from the
free space the previous eviction left), yet the client waited for it, and on a put of several parts the last
part's reply is the put's latency. The same holds for most of a Store's own work: its reply carries the
outcomes and the new spare slots, not the binding of its keys to their slots (the catalog, the policy, the key
index, events), which is done after it too (writes.py). So a call may leave that work (`defer`): the front end
runs it right after sending the reply (Engine.settle), and if any other caller takes the lock first, the lock
runs it before that caller's own work. No call ever sees the engine between the two halves, so every other
caller observes the same states as before (counters, key index, allocation), just later than the reply that caused them.

An exception in deferred work is logged, not raised: it belongs to a call that has already answered, and
raising it in an unrelated caller (a Lookup, the sweeper) would hand that caller someone else's error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from kvstore.errors import StoreUnavailableError

__all__ = ["EngineLock"]

log = logging.getLogger(__name__)


class EngineLock:
    """`with lock:` takes the engine's lock and first runs whatever a previous holder deferred.

    `freeze()` (a hand-over's window, kvstore/engine/restarts.py): from then on every other thread that takes the
    lock gets StoreUnavailableError instead (a peer's push, a straggling request): the state the successor was
    handed can no longer change here. Only the freezing thread goes on; `thaw()` ends it (the hand-over failed)."""

    __slots__ = ("_lock", "_deferred", "_frozen_by")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deferred: list[Callable[[], object]] = []
        self._frozen_by = 0  # the thread that froze the engine (0: not frozen)

    def __enter__(self) -> EngineLock:
        self._lock.acquire()
        if self._frozen_by and self._frozen_by != threading.get_ident():
            self._lock.release()
            raise StoreUnavailableError("kvstore-server is handing over to its successor; retry")
        if self._deferred:
            self._run_deferred()
        return self

    def freeze(self) -> None:
        with self:
            self._frozen_by = threading.get_ident()

    def thaw(self) -> None:
        self._frozen_by = 0

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._lock.release()

    @property
    def pending(self) -> bool:
        """Whether work waits for the next holder (read without the lock: a hint, settled under it)."""
        return bool(self._deferred)

    def settle(self) -> None:
        """Run now what a holder deferred (a no-op, without taking the lock, when nothing waits)."""
        if self._deferred:
            with self:
                pass

    def defer(self, work: Callable[[], object]) -> None:
        """Run `work` when the lock is next taken (the caller holds it now); once, however often it is left."""
        if work not in self._deferred:
            self._deferred.append(work)

    def _run_deferred(self) -> None:
        work, self._deferred = self._deferred, []
        for fn in work:
            try:
                fn()
            except Exception:
                log.exception("work deferred past a reply failed (%r); the engine keeps serving", fn)
