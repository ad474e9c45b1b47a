"""Handing a local client its arena file: a descriptor passed over a unix socket (SCM_RIGHTS) after the token
check. This is the only way to reach the arena's memory (files.py: the files have no name).

Protocol (one exchange per connection, little-endian)::

    client -> daemon   magic "KVARENA1" | u32 token length | token (<= 4096 bytes, empty without tokens)
    daemon -> client   magic "KVARENA1" | u32 status | u64 incarnation | u32 message length | message
                       + exactly one descriptor in the same message when status is OK

Status OK hands the caller's domain file: the shared one without tokens, the token's tenant's with them. A
missing or unknown token is refused (UNAUTHENTICATED) and nothing is handed out; a malformed request is refused
(BAD_REQUEST) and the connection closed. Each connection has one deadline for the whole exchange and at most
`max_clients` are served at once, so a client that connects and stalls holds nothing for long.

The socket is created 0600 next to the gRPC unix socket (same directory checks): only the daemon's user (and
root) can connect at all; tokens then decide which file a process gets.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvstore.arena.backing import SHARED_DOMAIN, ArenaBacking
from kvstore.errors import ConfigError, InvalidRequestError, StoreUnavailableError, UnauthenticatedError

__all__ = ["HandoffServer", "request_arena", "arena_socket_path", "MAX_TOKEN_BYTES"]

log = logging.getLogger(__name__)

MAGIC = b"KVARENA1"
_REQ = struct.Struct("<8sI")
_REP = struct.Struct("<8sIQI")
OK, UNAUTHENTICATED, BAD_REQUEST, UNAVAILABLE = 0, 1, 2, 3
MAX_TOKEN_BYTES = 4096
_MAX_MESSAGE = 1024


def arena_socket_path(unix_socket: str) -> str:
    """Where the daemon listens for arena requests: beside its gRPC socket."""
    return unix_socket + ".arena" if unix_socket else ""


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("arena request not complete before its deadline")
        sock.settimeout(left)
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("peer closed the connection mid-message")
        buf += got
    return bytes(buf)


class HandoffServer:
    """The daemon's side. `tenant_of(token)`: the token's tenant, or None when unknown; pass None for
    `tenant_of` itself when tokens are off (everyone gets the shared file)."""

    def __init__(self, path: str, backing: ArenaBacking, incarnation: int,
                 tenant_of: Callable[[str], str | None] | None, *, timeout_s: float = 2.0,
                 max_clients: int = 16) -> None:
        self.path = path
        self._backing = backing
        self._incarnation = incarnation
        self._tenant_of = tenant_of
        self._timeout = timeout_s
        self._slots = threading.BoundedSemaphore(max_clients)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.handed = 0       # files handed out
        self.refused = 0      # requests refused (bad token, malformed, busy)

    def start(self) -> None:
        _clear_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)
        sock.listen(64)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="kvstore-arena-handoff", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-arena-client", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            deadline = time.monotonic() + self._timeout
            status, message, fd = self._answer(conn, deadline)
            body = message.encode()[:_MAX_MESSAGE]
            reply = _REP.pack(MAGIC, status, self._incarnation, len(body)) + body
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            if fd is None:
                self.refused += 1
                conn.sendall(reply)
            else:
                socket.send_fds(conn, [reply], [fd])
                self.handed += 1
        except (OSError, ValueError) as exc:
            self.refused += 1
            log.info("arena request dropped: %s", exc)
        finally:
            conn.close()
            self._slots.release()

    def _answer(self, conn: socket.socket, deadline: float) -> tuple[int, str, int | None]:
        magic, n = _REQ.unpack(_recv_exact(conn, _REQ.size, deadline))
        if magic != MAGIC:
            return BAD_REQUEST, "not an arena request (bad magic)", None
        if n > MAX_TOKEN_BYTES:
            return BAD_REQUEST, f"token of {n} bytes is longer than {MAX_TOKEN_BYTES}", None
        token = _recv_exact(conn, n, deadline).decode("utf-8", "replace") if n else ""
        if self._tenant_of is None:
            domain = SHARED_DOMAIN
        else:
            tenant = self._tenant_of(token) if token else None
            if not tenant:
                why = "missing bearer token" if not token else "invalid bearer token (not in the daemon's tokens_file)"
                log.warning("refused an arena request: %s", why)
                return UNAUTHENTICATED, why, None
            domain = tenant
        try:
            return OK, "", self._backing.file_of(domain).fd
        except (OSError, ConfigError) as exc:
            return UNAVAILABLE, f"cannot create the arena file: {exc}", None


def _clear_stale_socket(path: str) -> None:
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left by a dead daemon
        return
    finally:
        probe.close()
    raise ConfigError(f"arena socket {path} is in use by a running process: stop it or choose another unix_socket")


def request_arena(path: str, token: str, timeout_s: float = 5.0) -> tuple[int, int]:
    """The client's side: (descriptor of this caller's arena file, the daemon's incarnation).

    Raises UnauthenticatedError (token missing or unknown), StoreUnavailableError (socket absent, daemon gone
    or not answering), InvalidRequestError (the daemon refused the request)."""
    body = token.encode()
    if len(body) > MAX_TOKEN_BYTES:
        raise InvalidRequestError(f"token of {len(body)} bytes is longer than {MAX_TOKEN_BYTES}")
    deadline = time.monotonic() + timeout_s
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(_REQ.pack(MAGIC, len(body)) + body)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        data, fds, _, _ = socket.recv_fds(sock, _REP.size + _MAX_MESSAGE, 1)
        if len(data) < _REP.size:
            data += _recv_exact(sock, _REP.size - len(data), deadline)
        magic, status, incarnation, n = _REP.unpack(data[:_REP.size])
        message = data[_REP.size:]
        if len(message) < n:
            message += _recv_exact(sock, n - len(message), deadline)
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise StoreUnavailableError(f"cannot get the arena from {path}: {exc.strerror or exc}") from exc
    finally:
        sock.close()
    text = message.decode("utf-8", "replace")
    if magic != MAGIC or (status == OK and len(fds) != 1):
        for fd in fds:
            os.close(fd)
        raise StoreUnavailableError(f"{path} did not answer an arena request (is it a kvstore-server's socket?)")
    if status != OK:
        for fd in fds:
            os.close(fd)
        if status == UNAUTHENTICATED:
            raise UnauthenticatedError(f"arena refused: {text}")
        if status == BAD_REQUEST:
            raise InvalidRequestError(f"arena refused: {text}")
        raise StoreUnavailableError(f"arena unavailable: {text}")
    return fds[0], incarnation
