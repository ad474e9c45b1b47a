"""The two socket chores both ends of the same-node socket share (the protocol itself stays sans-IO)."""

from __future__ import annotations

import os
import socket

from kvstore.errors import ConfigError

__all__ = ["recv_exact", "clear_stale_socket"]


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes, read with recv_into into one buffer; ConnectionError when the peer closes first."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = sock.recv_into(view[pos:], n - pos)
        if not got:
            raise ConnectionError("the other end closed the connection")
        pos += got
    return bytes(buf)


def clear_stale_socket(path: str, what: str) -> None:
    """Remove a socket file nobody listens on (left by a dead daemon); ConfigError when a process listens."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ConfigError(f"{what} {path} is in use by a running process: stop it or choose another unix_socket")
