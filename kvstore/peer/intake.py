"""What a node takes when a peer hands blocks to it after a membership change (a PUSH with the HANDOFF flag).

Two checks, both counted, neither of which closes the connection (the frame is well-formed; its refused
blocks are read into scratch and the reply says how many were stored):

- ownership: a block is taken only when this node owns it under its member view (change.MemberView.accepts:
  the current set, one rank past it for a member that is leaving, or a set of the hand-off window). A peer that
  hands over blocks this node does not own, by a bug or on purpose, cannot fill its arena with them
  (`handoff_refused`).
- rate: hand-off bytes are admitted through a token bucket of `bytes_per_s` (peer_handoff_intake_bytes_per_s)
  with one second of burst. A frame arriving while the bucket is empty is refused whole
  (`handoff_flood_refused`), so a peer that floods hand-offs costs this node the bytes it reads and drops, never
  its RAM: local clients' puts keep their room. A frame of any size is admitted while the bucket holds a
  token (it may then run into debt, repaid before the next one): the bound is on the average rate, and no
  frame is too big to ever pass.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvstore.peer.change import MemberView
from kvstore.peer.counters import PeerCounters

__all__ = ["HandOffIntake", "TokenBucket"]


class TokenBucket:
    """Bytes per second with `burst_s` seconds of burst; take() may run the bucket into debt (see above)."""

    def __init__(self, bytes_per_s: float, burst_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"a token bucket needs a positive rate, not {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self._cap = self.rate * burst_s
        self._clock = clock
        self._tokens = self._cap
        self._at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._cap, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def try_take(self, n: int) -> bool:
        """Take n bytes' worth when the bucket holds any token; False (nothing taken) when it is empty."""
        with self._lock:
            self._refill()
            if self._tokens <= 0:
                return False
            self._tokens -= n
            return True

    def wait_time(self) -> float:
        """Seconds until the bucket holds a token again (0: now)."""
        with self._lock:
            self._refill()
            return 0.0 if self._tokens > 0 else (-self._tokens + 1) / self.rate


class HandOffIntake:
    def __init__(self, view: MemberView, counters: PeerCounters, bytes_per_s: float) -> None:
        self._view = view
        self._counters = counters
        self._bucket = TokenBucket(bytes_per_s)

    def __call__(self, namespace: str, keys: list[bytes], payload_bytes: int) -> list[bool]:
        """Per block: take it or not (LocalStore.admit_handoff's answer)."""
        if not self._bucket.try_take(payload_bytes):
            self._counters.add("handoff_flood_refused")
            return [False] * len(keys)
        out = self._view.accepts(namespace, keys)
        refused = out.count(False)
        if refused:
            self._counters.add("handoff_refused", refused)
        return out
