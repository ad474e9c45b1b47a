"""Lease releases sent from one long-lived background thread.

A reader has its bytes once the copy and the generation check are done, so it should not wait for the
Release round trip. grpc's `.future()` looked like the answer but costs the caller more than a blocking call
here (it starts a channel thread whenever no other call is in flight). Instead, ids go into a queue and one
thread sends them, coalescing whatever accumulated into a single Release. A lost release is harmless: the
daemon drops the lease at its TTL.
"""

from __future__ import annotations

import logging
import queue
import threading

from collections.abc import Callable

from kvstore.client.fast_channel import quiet_thread
from kvstore.errors import KVStoreError
from kvstore.validation import MAX_RELEASE_IDS

__all__ = ["Releaser"]

log = logging.getLogger(__name__)
_STOP: list[int] = []


class Releaser:
    def __init__(self, release: Callable[[list[int]], object]) -> None:
        """`release(ids)`: the client's Release on its current control path (fast or gRPC)."""
        self._release = release
        self._queue: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, lease_ids: list[int]) -> None:
        if self._closed:  # a copy that outlived its client's close(): the daemon expires the lease by TTL
            return
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="kvstore-release", daemon=True)
                    self._thread.start()
        self._queue.put(lease_ids)

    def _run(self) -> None:
        quiet_thread()  # nobody waits on a release: its calls must not poll a core away (fast_channel.py)
        while True:
            ids = self._queue.get()
            if ids is _STOP:
                return
            batch = list(ids)
            stop = False
            while True:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:
                    stop = True
                    break
                batch.extend(more)
            for start in range(0, len(batch), MAX_RELEASE_IDS):  # the daemon's per-call limit
                part = batch[start:start + MAX_RELEASE_IDS]
                try:
                    self._release(part)
                except (KVStoreError, ValueError) as exc:  # ValueError: a closed gRPC channel
                    log.debug("release of %d leases failed (%s); the daemon expires them by TTL", len(part), exc)
            if stop:
                return

    def close(self, timeout_s: float) -> None:
        """Send what is queued, then stop the thread."""
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
            self._thread = None
