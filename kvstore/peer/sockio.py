"""Blocking socket reads and writes bounded by a Deadline (deadline.py), for the TCP data plane.

Every recv and send re-arms the socket timeout from the deadline's remaining time, so the deadline bounds the
whole transfer, not each call. A timeout becomes DeadlineExceeded (with the bytes of the buffer that did
arrive); the other side closing becomes ConnectionClosed (`clean` when it closed at a frame boundary).
Works on plain and TLS sockets alike (the ssl module's own sendall restarts its timeout per record, so
send_all loops over send itself).
"""

from __future__ import annotations

import socket

from kvstore.peer.deadline import Deadline, DeadlineExceeded

__all__ = ["ConnectionClosed", "recv_exact", "recv_into_exact", "drain", "send_all", "tune"]

_DRAIN_CHUNK = 1 << 20
_SOCK_BUF = 4 << 20


class ConnectionClosed(Exception):
    """The other side closed the connection (at a frame boundary when `clean`)."""

    def __init__(self, clean: bool) -> None:
        super().__init__("connection closed" + ("" if clean else " mid-frame"))
        self.clean = clean


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fill `view`; DeadlineExceeded(received=bytes in view) when the deadline comes first."""
    pos, n = 0, len(view)
    while pos < n:
        try:
            deadline.arm(sock)
            got = sock.recv_into(view[pos:], n - pos)
        except (TimeoutError, DeadlineExceeded):
            raise DeadlineExceeded(deadline, pos) from None
        if not got:
            raise ConnectionClosed(clean=False)
        pos += got


def recv_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def drain(sock: socket.socket, n: int, deadline: Deadline) -> None:
    """Read and drop n bytes (blocks this node cannot, need not or may no longer store)."""
    scratch = memoryview(bytearray(min(n, _DRAIN_CHUNK) or 1))
    while n:
        k = min(n, len(scratch))
        recv_into_exact(sock, scratch[:k], deadline)
        n -= k


def send_all(sock: socket.socket, data: bytes | memoryview, deadline: Deadline) -> None:
    view = memoryview(data).cast("B")
    pos, n = 0, len(view)
    while pos < n:
        try:
            deadline.arm(sock)
            pos += sock.send(view[pos:])
        except (TimeoutError, DeadlineExceeded):
            raise DeadlineExceeded(deadline, pos) from None


def tune(sock: socket.socket) -> None:
    """No Nagle delay on small frames; buffers that hold a couple of 2 MiB blocks."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
