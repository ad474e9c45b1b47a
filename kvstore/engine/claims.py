"""Claims: "this scheduler is computing these blocks now and will save them", so that another one waits.

Why: two vLLM servers that get prompts sharing a prefix at the same time (two sessions of one agent starting
together, sub-agents forked at once) both miss, and both compute the prefix; on one server vLLM's own prefix
cache shares a prefix that is still being computed, across servers nothing did. A scheduler whose lookup
misses now claims the keys it is about to compute (Claim RPC); a scheduler on another server that misses the
same keys while that claim lives learns they are *pending* and loads them asynchronously, waiting for the
claimant's save (kvstore_connector/claims.py), instead of computing them too.

Where a claim lives: on the node the claimant asked, and (peer tier) at each key's owner, where every other
node's Claim asks (kvstore/peer/remote_tier.py `claim`), so a claim is seen cluster-wide with no extra round
trip beyond the one that makes it. A claim ends when its key is stored (a held key answers HELD before any
claim is looked at) or when its time runs out (the claimant was preempted, aborted or died: waiters then
compute, having lost at most the claim's time). The table is bounded (`max_keys`); expired claims leave it as new
ones are made (the oldest first), and when it is full of live claims a new one is refused (counted) and its
caller simply computes, as without claims.

Per key a Claim answers one state:
    CLAIMED  0  no one else is computing it: it is the caller's now (compute it)
    HELD     1  stored somewhere (here, or at its owner): load it
    PENDING  2  another claimant's live claim: wait for it, then load it
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvstore.errors import InvalidRequestError

__all__ = ["ClaimTable", "CLAIMED", "HELD", "PENDING", "MAX_CLAIMANT_BYTES", "MAX_CLAIM_MS", "check_claim"]

CLAIMED, HELD, PENDING = 0, 1, 2
MAX_CLAIMANT_BYTES = 64
MAX_CLAIM_MS = 600_000  # ten minutes: a prefill that takes longer is not worth waiting for


def check_claim(claimant: bytes, ttl_ms: int) -> None:
    """A Claim's own fields (its keys are checked as every request's are): a clear error, nothing recorded."""
    if not 1 <= len(claimant) <= MAX_CLAIMANT_BYTES:
        raise InvalidRequestError(f"claimant of {len(claimant)} bytes (1 to {MAX_CLAIMANT_BYTES}: a stable id of "
                                  f"the scheduler that will compute the keys)")
    if not 1 <= ttl_ms <= MAX_CLAIM_MS:
        raise InvalidRequestError(f"claim ttl_ms {ttl_ms} (1 to {MAX_CLAIM_MS}: how long until the claimant's "
                                  f"save is expected)")


class ClaimTable:
    """(namespace, key) -> (claimant, deadline). Thread-safe (its own lock: never under the engine's)."""

    def __init__(self, max_keys: int, clock=time.monotonic) -> None:  # noqa: ANN001 - a test's fake clock
        self._max = max_keys
        self._clock = clock
        self._claims: dict[tuple[str, bytes], tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self.refused = 0  # keys answered CLAIMED but not recorded: the table was full of live claims

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, namespace: str, keys: Sequence[bytes], known: Sequence[int | None], claimant: bytes,
              ttl_ms: int) -> list[int]:
        """Per key its state (module docstring). `known[i]`: HELD or PENDING where the caller already knows
        (this node's tiers, the key's owner's answer), None where this table decides: another claimant's live
        claim is PENDING, anything else becomes (or stays, renewed) the caller's."""
        now = self._clock()
        deadline = now + ttl_ms / 1000.0
        out: list[int] = []
        with self._lock:
            self._expire_oldest(now)
            for key, k in zip(keys, known):
                if k is not None:
                    out.append(k)
                    continue
                held = self._claims.get((namespace, key))
                if held is not None and held[0] != claimant and held[1] > now:
                    out.append(PENDING)
                    continue
                if held is None and len(self._claims) >= self._max and not self._prune(now):
                    self.refused += 1
                else:
                    self._claims.pop((namespace, key), None)  # renewed or taken over: to the end of the order
                    self._claims[(namespace, key)] = (claimant, deadline)
                out.append(CLAIMED)
        return out

    def _expire_oldest(self, now: float) -> None:
        """Drop the expired claims at the front of the table (the order is the order they were made or renewed
        in, so with one claim time everywhere these are all the expired ones): amortized O(1) a claim, so the
        table holds about the claims that live, not `max_keys` of old ones."""
        while self._claims:
            k, (_, d) = next(iter(self._claims.items()))
            if d > now:
                return
            del self._claims[k]

    def _prune(self, now: float) -> bool:
        """Drop expired claims (called when full); whether there is room now."""
        for k in [k for k, (_, d) in self._claims.items() if d <= now]:
            del self._claims[k]
        return len(self._claims) < self._max
