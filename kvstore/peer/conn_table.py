"""The TCP listener's live connections, each either idle (waiting for its next header) or busy (mid-frame).

Why a table and not a counter: with a plain limit, 64 sockets that connect and send nothing lock every real
peer out for as long as they stay open. Here a full table admits a new connection by closing the one that
has been idle longest (`idle_evicted`); only when every connection is busy is the newcomer refused
(`conn_refused`). Busy connections cannot hold a place for long either: each frame has a deadline
(peer_timeout_s), after which its connection is closed. So an attacker keeps a place only by sending frames
that are served, which is load, not a lock-out. A connection counts as idle from the moment it is accepted:
one that has not finished its TLS handshake or sent its first header is the cheapest one to lose.

    admit(sock)      -> Conn, or None (refused, counted) when full of busy connections
    busy(conn)       a header started arriving; False when the table already evicted it (stop serving)
    idle(conn)       the frame is done; idle from now
    swap(conn, s)    the TLS socket replaces the raw one after the handshake
    remove(conn)     the connection's thread is done with it
    counts()         (idle, busy) now
    close_all()      stop(): shut every socket down so its thread returns

Idle connections also close on their own after `idle_timeout_s` (the serving thread's wait for the next
header is bounded; `idle_closed`).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

from kvstore.peer.counters import PeerCounters

__all__ = ["Conn", "ConnTable"]


@dataclass(eq=False)
class Conn:
    sock: socket.socket
    idle_since: float | None = field(default_factory=time.monotonic)  # None while a frame is in progress
    evicted: bool = False


class ConnTable:
    def __init__(self, limit: int, counters: PeerCounters) -> None:
        self.limit = limit
        self._counters = counters
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._conns)

    def counts(self) -> tuple[int, int]:
        """(idle, busy) connections now (tests and inspection)."""
        with self._lock:
            idle = sum(c.idle_since is not None for c in self._conns)
            return idle, len(self._conns) - idle

    def admit(self, sock: socket.socket) -> Conn | None:
        with self._lock:
            if len(self._conns) >= self.limit:
                idle = [c for c in self._conns if c.idle_since is not None]
                if not idle:
                    self._counters.add("conn_refused")
                    return None
                victim = min(idle, key=lambda c: c.idle_since)  # type: ignore[arg-type, return-value]  # all idle: idle_since set
                victim.evicted = True
                self._conns.discard(victim)
                self._counters.add("idle_evicted")  # counted before anyone can see the socket close
                _shutdown(victim.sock)  # its thread wakes with EOF or an error, sees `evicted`, closes
            conn = Conn(sock)
            self._conns.add(conn)
            return conn

    def busy(self, conn: Conn) -> bool:
        with self._lock:
            if conn.evicted:
                return False
            conn.idle_since = None
            return True

    def idle(self, conn: Conn) -> None:
        with self._lock:
            conn.idle_since = time.monotonic()

    def swap(self, conn: Conn, sock: socket.socket) -> bool:
        """Serve `sock` from now on (TLS over the raw socket); False when the connection was evicted."""
        with self._lock:
            conn.sock = sock
            return not conn.evicted

    def remove(self, conn: Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def close_all(self) -> None:
        with self._lock:
            for c in self._conns:
                _shutdown(c.sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
