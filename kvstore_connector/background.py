"""A bounded queue drained by one background thread: how the connector does store work off vLLM's threads.

The thread starts with the first item and ends after ``idle_s`` without one (the next item starts it again), so
an idle or forgotten connector holds no thread. A full or closed queue refuses an item at once (the caller
counts it); `flush` waits until every accepted item is handled, `close` flushes and stops the thread. The
handler gets the items taken at once (all of them, or one when ``one_at_a_time``) and does its own error
counting; an exception it lets out is logged and the thread lives on.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from kvstore.client.fast_channel import quiet_thread

__all__ = ["Background"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class Background(Generic[T]):
    def __init__(self, name: str, handle: Callable[[list[T]], None], *, capacity: int, idle_s: float,
                 one_at_a_time: bool = False) -> None:
        self.name, self.capacity, self.idle_s = name, capacity, idle_s
        self._handle, self._one = handle, one_at_a_time
        self._queue: deque[T] = deque()
        self._cond = threading.Condition()
        self._pending = 0  # accepted, not yet handled
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def running(self) -> bool:
        return self._thread is not None

    def submit(self, item: T) -> bool:
        """Queue ``item``; False (not queued) when the queue is full or closed. Never blocks."""
        with self._cond:
            if self._closed or len(self._queue) >= self.capacity:
                return False
            self._queue.append(item)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every accepted item is handled; False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Handle what is queued (flush), then stop the thread; later items are refused."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        quiet_thread()  # nobody waits on this thread's calls: they must not poll a core away (fast_channel.py)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed, timeout=self.idle_s)
                if not self._queue:  # closed, or idle: a later submit starts a new thread
                    self._thread = None
                    return
                items = [self._queue.popleft()] if self._one else list(self._queue)
                if not self._one:
                    self._queue.clear()
            try:
                self._handle(items)
            except Exception:  # noqa: BLE001 - the thread must live on
                log.exception("%s: handling %d item(s) failed", self.name, len(items))
            with self._cond:
                self._pending -= len(items)
                self._cond.notify_all()
