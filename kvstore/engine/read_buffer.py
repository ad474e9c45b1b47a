"""Deferred policy bookkeeping for hits (the read buffer of Caffeine / CacheLib's deferred LRU refresh).

A Lookup of 280 keys used to spend more time moving entries to the head of the LRU than everything else
together. Now it only appends the array of hit ids here. The engine applies the buffer, in order, before
anything else touches the policy (an insert on commit, a victim choice, a delete) and from the sweeper, so
the policy sees exactly the sequence of events it would have seen inline, and every buffered id is still
tracked (no removal can happen between recording and applying). The buffer is bounded: past
`max_pending` ids it is applied at once.
"""

from __future__ import annotations

import numpy as np

from kvstore.policies import EvictionPolicy

__all__ = ["ReadBuffer"]


class ReadBuffer:
    def __init__(self, policy: EvictionPolicy, max_pending: int = 1 << 16) -> None:
        self._policy = policy
        self._batches: list[np.ndarray] = []
        self._pending = 0
        self._max = max_pending

    def record(self, ids: np.ndarray) -> None:
        if len(ids):
            self._batches.append(ids)
            self._pending += len(ids)
            if self._pending > self._max:
                self.apply()

    def apply(self) -> None:
        """Replay the buffered hits in one call (the policy does its work for all of them in a few numpy calls,
        and skips what later hits make moot: see `on_access_batches`)."""
        if self._batches:
            self._policy.on_access_batches(self._batches)
            self._batches.clear()
            self._pending = 0

    def __len__(self) -> int:
        return self._pending
