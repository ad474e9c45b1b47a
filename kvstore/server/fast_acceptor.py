"""The same-node socket's listener: accepts connections and hands each to the fast server, and can stop
accepting without closing (a hand-over's freeze: the successor accepts on the same socket).

The listening socket is non-blocking and polled together with a wake-up pipe: `pause` wakes the accept thread
without touching the socket, which a successor holds a copy of (the same open file, so the same O_NONBLOCK: both
poll, then accept, and an accept that finds nothing because the other took it just polls again).
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable

from kvstore.fastpath.sockets import clear_stale_socket

__all__ = ["Acceptor"]


class Acceptor:
    def __init__(self, path: str, on_conn: Callable[[socket.socket], None]) -> None:
        self.path = path
        self._on_conn = on_conn
        self.sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1

    def start(self, listener: socket.socket | None = None) -> None:
        """Bind the path (0600), or take `listener` (a predecessor's), and accept on a thread."""
        if listener is None:
            clear_stale_socket(self.path, "arena socket")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.path)
            os.chmod(self.path, 0o600)
        listener.listen(1024)
        listener.setblocking(False)
        self.sock = listener
        self.resume()

    def resume(self) -> None:
        if self.sock is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="kvstore-fast-accept", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop accepting; the socket stays open and listening (connections wait in its backlog)."""
        if self._thread is not None and self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=2)
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def close(self) -> None:
        """Stop, close the socket and remove the path (a daemon's shutdown; never after a hand-over)."""
        self.pause()
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _loop(self) -> None:
        assert self.sock is not None
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            try:
                ready = poller.poll()
            except InterruptedError:
                continue
            if any(fd == self._wake_r for fd, _ in ready):
                return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                continue  # another process sharing the listener took it
            except OSError:
                return  # closed
            conn.setblocking(True)
            self._on_conn(conn)
