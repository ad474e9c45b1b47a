"""Writes to peers: after a local put, push each block to its owner (and under owner+1 one replica) in the background.

The engine calls `committed(reservation_id, namespace, keys)` inside Commit, under its lock, so it only appends
to a bounded queue and returns: a put never waits for a peer. One pusher thread drains the queue, groups keys
by (target peer, namespace) into batches of up to `batch_keys`, opens them from the arena (a lease holds the
slots while the bytes are on the wire) and makes one push call per batch.

Dropped and counted (`pushes_dropped`), never retried: a full queue, a target that is down, a call that fails
or times out. A block that came from a peer (fetched or pushed here) is not pushed again (LocalStore.is_own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvstore.peer.counters import PeerCounters
from kvstore.peer.local import LocalStore
from kvstore.peer.membership import Member
from kvstore.peer.placement import owners_of
from kvstore.peer.plane import DataPlane, PeerCallError, PeerTimeout

__all__ = ["Replicator"]

log = logging.getLogger(__name__)


class Replicator:
    def __init__(self, local: LocalStore, plane: DataPlane, members: Callable[[], dict[str, Member]], me: str, *,
                 copies: int, queue_blocks: int, counters: PeerCounters, batch_keys: int = 32,
                 landed: Callable[[str, list[bytes]], None] = lambda ns, keys: None,
                 placement: Callable[[], frozenset[str]] | None = None) -> None:
        self._local = local
        self._plane = plane
        self._members = members
        self._me = me
        self._copies = copies
        self._max_queue = queue_blocks
        self._batch = batch_keys
        self._counters = counters
        self._landed = landed  # keys now at their owner (guests.py lets go of this node's copy)
        self._placement = placement  # () -> the members that own blocks (not leaving); None: every member
        self._queue: deque[tuple[str, tuple[bytes, ...]]] = deque()
        self._queued = 0
        self._busy = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvstore-peer-pusher", daemon=True)

    def start(self) -> None:
        if self._copies:
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    @property
    def pending(self) -> int:
        """Blocks queued or being pushed (0: every push so far has been attempted)."""
        with self._cond:
            return self._queued + self._busy

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued push has been attempted (True), or timeout_s (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queued + self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def committed(self, reservation_id: int, namespace: str, keys: Sequence[bytes]) -> None:
        """Engine hook, under the engine lock: queue a commit's blocks for pushing; never blocks."""
        if not self._copies or self._local.is_own(reservation_id):
            return
        with self._cond:
            if self._queued + len(keys) > self._max_queue:
                self._counters.add("pushes_dropped", len(keys))
                return
            self._queue.append((namespace, tuple(keys)))
            self._queued += len(keys)
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    self._counters.add("pushes_dropped", self._queued)
                    return
                items = list(self._queue)
                self._queue.clear()
                self._busy, self._queued = self._queued, 0
            try:
                self._push(items)
            except Exception:  # the pusher must survive a bug in one round
                log.exception("peer push round failed")
            finally:
                with self._cond:
                    self._busy = 0

    def _push(self, items: list[tuple[str, tuple[bytes, ...]]]) -> None:
        members = self._members()
        ids = self._placement() if self._placement is not None else frozenset(members)
        batches: dict[tuple[str, str], list[bytes]] = {}
        for namespace, keys in items:
            for key, targets in zip(keys, owners_of(namespace, keys, ids, self._copies)):
                for target in targets:
                    if target != self._me and target in members:
                        batches.setdefault((target, namespace), []).append(key)
        failed: set[tuple[str, bytes]] = set()
        for (target, namespace), queued in batches.items():
            desc = self._local.describe(namespace)
            for i in range(0, len(queued), self._batch):
                part = queued[i: i + self._batch]
                try:
                    self._plane.push(members[target], desc, part)  # the owner may hold some already: fine
                except PeerCallError as exc:
                    self._counters.add("pushes_dropped", len(part))
                    self._counters.add("timeouts" if isinstance(exc, PeerTimeout) else "errors")
                    log.info("push of %d blocks to %s dropped: %s", len(part), target, exc)
                    failed.update((namespace, k) for k in part)
                    continue
                self._counters.add("pushed_blocks", len(part))
        # only now, when every owner of a block has been sent it: the owner's push reads this node's copy
        landed: dict[str, list[bytes]] = {}
        for (_, namespace), queued in batches.items():
            landed.setdefault(namespace, []).extend(k for k in queued if (namespace, k) not in failed)
        for namespace, sent in landed.items():
            self._landed(namespace, list(dict.fromkeys(sent)))
