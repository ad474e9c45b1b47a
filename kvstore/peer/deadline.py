"""Deadlines for the peer data planes: one point in time per frame, per call and per idle wait.

Why not socket timeouts: a timeout set once restarts at every recv, so a peer that trickles one byte per
second never trips a 1 s timeout and can hold a frame (and the arena slots it was reserved into) open
forever. A `Deadline` is fixed when the frame starts; every receive recomputes the socket timeout from what
is left (`arm`), so the whole frame, however it is split into recvs, must arrive before it.

    Deadline(seconds, what)   starts now (time.monotonic)
      remaining()             seconds left (may be <= 0)
      arm(sock)               settimeout(remaining) or raise DeadlineExceeded when nothing is left
      until(at, what)         the earlier of this deadline and a point in time (a reservation's or lease's
                              safe end), named for the message and for the caller to tell which one fired

DeadlineExceeded carries the deadline that fired and how many bytes of the current buffer had arrived, so a
receiver cut off by a reservation's deadline (not the frame's) can drain the rest of the frame into scratch.
"""

from __future__ import annotations

import socket
import time

__all__ = ["Deadline", "DeadlineExceeded"]


class DeadlineExceeded(Exception):
    """A frame, call or idle wait ran past its deadline; `received` bytes of the current buffer had arrived."""

    def __init__(self, deadline: Deadline, received: int = 0) -> None:
        super().__init__(f"{deadline.what} did not complete within {deadline.seconds:.3g}s")
        self.deadline = deadline
        self.received = received


class Deadline:
    __slots__ = ("at", "seconds", "what")

    def __init__(self, seconds: float, what: str, *, at: float | None = None) -> None:
        self.at = time.monotonic() + seconds if at is None else at
        self.seconds = seconds
        self.what = what

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def arm(self, sock: socket.socket) -> float:
        """Set the socket's timeout to what is left; raise DeadlineExceeded when nothing is."""
        left = self.remaining()
        if left <= 0:
            raise DeadlineExceeded(self)
        sock.settimeout(left)
        return left

    def until(self, at: float, what: str) -> Deadline:
        """This deadline, or a new one at `at` when that comes first (e.g. a reservation's safe end)."""
        if at >= self.at:
            return self
        return Deadline(max(0.0, at - (self.at - self.seconds)), what, at=at)

    def __repr__(self) -> str:
        return f"Deadline({self.what!r}, {self.remaining():.3f}s left)"
