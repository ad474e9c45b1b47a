"""vLLM identities sent ahead of their puts (Annotate), until the publisher's thread takes them.

The Annotate RPC returns before its client sends the Store or Commit of the same keys, so by the time the engine
publishes those keys' stored event the publisher finds their identity here (`take`, by Residency's `origin_of`).
An identity for a key already held (sent after its put, or changed) is re-checked by the publisher's thread
(`recent`): Residency.annotate renames the block. Bounded: past `capacity` the oldest identities go (a put that
never came: a failed save), counted in `dropped`. Thread-safe: RPC threads put, the publisher's thread takes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvstore.origins import BlockOrigin

__all__ = ["OriginBook"]


class OriginBook:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an origin book holds at least 1 identity, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, bytes], BlockOrigin] = OrderedDict()
        self._recent: list[tuple[str, bytes]] = []
        self.kept = 0      # identities accepted, ever
        self.dropped = 0   # identities dropped unused for room, ever

    def put(self, namespace: str, keys: Sequence[bytes], origins: Sequence[BlockOrigin]) -> int:
        with self._lock:
            for key, origin in zip(keys, origins):
                self._pending[(namespace, key)] = origin
                self._pending.move_to_end((namespace, key))
                self._recent.append((namespace, key))
            while len(self._pending) > self.capacity:
                self._pending.popitem(last=False)
                self.dropped += 1
            if len(self._recent) > self.capacity:  # the publisher is far behind: the oldest re-checks go too
                del self._recent[: len(self._recent) - self.capacity]
            self.kept += len(keys)
        return len(keys)

    def take(self, namespace: str, key: bytes) -> BlockOrigin | None:
        with self._lock:
            return self._pending.pop((namespace, key), None)

    def recent(self) -> list[tuple[str, bytes]]:
        """Keys given an identity since the last call, in order (each to re-check once)."""
        with self._lock:
            out, self._recent = self._recent, []
        return out

    def __len__(self) -> int:
        return len(self._pending)
