"""The client's end of the same-node fast path (kvstore/fastpath/protocol.py) and of the arena handoff.

`FastChannel` keeps one connection per calling thread (so threads never wait for each other's replies, and no
lock is held across a round trip); each connection says HELLO with the client's token once. A call is one
`sendall` of the request frame and a read of the reply frame: no other work on the way. A connection found
dead when sending (it died while idle: a daemon restart) is replaced and the request sent again, since the
daemon never read it. A connection that fails later (daemon gone mid-call, closed for a bad frame, token
revoked) is dropped and the error raised as the same exception a gRPC call would raise
(StoreUnavailableError, UnauthenticatedError, ...): the request may have been applied, so it is not repeated.
The next call dials anew, which also finds a restarted daemon (its incarnation comes back in the replies).

A call polls for its reply for up to `spin_us` before it sleeps in recv (FrameReader.spin_s; $KVSTORE_SPIN_US,
default 300 us): the wake-up from sleep costs a VM 20-30 us, as much as the daemon's work on a short call. A thread
marked with `quiet_thread` (work nobody waits on: a connector's commit thread, background releases) never polls.

`request_arena` is the one-shot exchange that hands a process its arena file (HELLO asking for it).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvstore.errors import ConfigError, KVStoreError, StoreUnavailableError, error_for_reason
from kvstore.fastpath import protocol as fp
from kvstore.fastpath.sockets import MAX_SPIN_US, FrameReader, recv_exact, set_kernel_timeouts

__all__ = ["FastChannel", "FastConn", "decoded_reply", "UNENCODABLE", "request_arena", "request_key_index",
           "spin_us_from_env", "quiet_thread", "DEFAULT_SPIN_US", "MAX_SPIN_US"]

_T = TypeVar("_T")
# what encoding a caller's request can raise (a key over 255 bytes, a namespace that is not a string, ...):
# the request then goes the other way (gRPC, Reserve), whose own checks say what is wrong
UNENCODABLE = (fp.FrameError, TypeError, AttributeError, ValueError, OverflowError)
DEFAULT_SPIN_US = 300   # covers the daemon's answer to the hot calls (bench.fast_profile: 60-250 us on 2 cores)
_thread_mode = threading.local()  # .quiet: this thread's calls never poll (quiet_thread)


def quiet_thread() -> None:
    """Mark the calling thread as one nobody waits on (a connector's commit thread, background releases): its
    calls sleep in recv at once instead of polling for the reply, on any connection. Why: such a thread runs
    while another thread of the process copies on every core, and polling takes a core from that copy
    (bench.connector --chunk 512, 2 cores: the commit thread's Store used ~225 us of CPU a step polling, ~85 us
    sleeping, and the saves ran at 0.835-0.847 of the copy limit polling, 0.851-0.857 sleeping, alternating)."""
    _thread_mode.quiet = True


def _raise_error(body: bytes) -> None:
    reason, message = fp.decode_error(body)
    raise error_for_reason(reason)(message)


def decoded_reply(decode: Callable[[bytes], _T], body: bytes) -> _T:
    """A reply body decoded; a body the format rejects is the daemon's fault: StoreUnavailableError."""
    try:
        return decode(body)
    except fp.FrameError as exc:
        raise StoreUnavailableError(f"garbled fast-path reply from the daemon: {exc}") from exc


def _dial(path: str, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def request_arena(path: str, token: str, timeout_s: float = 5.0) -> tuple[int, int]:
    """(descriptor of this caller's arena file, the daemon's incarnation).

    UnauthenticatedError (token missing or unknown), StoreUnavailableError (socket absent, daemon gone, not
    answering, or full), InvalidRequestError (the daemon refused the request as malformed)."""
    return _request_file(path, token, timeout_s, want_arena=True)


def request_key_index(path: str, token: str, timeout_s: float = 5.0) -> tuple[int, int]:
    """(read-only descriptor of this caller's tenant's shared key index, the daemon's incarnation); the errors of
    request_arena, and StoreUnavailableError when the daemon runs without an index."""
    return _request_file(path, token, timeout_s, want_arena=False)


def _request_file(path: str, token: str, timeout_s: float, want_arena: bool) -> tuple[int, int]:
    """The one-shot exchange that hands over a file: HELLO asking for it, the reply with it over SCM_RIGHTS."""
    what = "arena" if want_arena else "key index"
    hello = fp.frame(fp.HELLO, fp.encode_hello(token, want_arena=want_arena, want_index=not want_arena))
    fds: list[int] = []
    try:
        sock = _dial(path, timeout_s)
    except OSError as exc:
        raise StoreUnavailableError(f"cannot get the {what} from {path}: {exc.strerror or exc}") from exc
    try:
        sock.sendall(hello)
        data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        if len(data) < fp.HEADER.size:
            data += recv_exact(sock, fp.HEADER.size - len(data))
        head = fp.Header.parse(data[:fp.HEADER.size])
        body = data[fp.HEADER.size:]
        if len(body) < head.length:
            body += recv_exact(sock, head.length - len(body))
        if head.status != fp.OK:
            _raise_error(body)
        incarnation, _ = fp.decode_hello_reply(body)
        if len(fds) != 1:
            raise StoreUnavailableError(f"{path} answered without the {what} file")
        return fds.pop(), incarnation
    except (OSError, fp.FrameError) as exc:
        raise StoreUnavailableError(f"cannot get the {what} from {path}: {exc}") from exc
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


class FastConn:
    __slots__ = ("sock", "ids", "reader", "incarnation", "unsettled", "spares", "spares_refused", "dead")

    def __init__(self, sock: socket.socket, timeout_s: float, spin_us: int, incarnation: int) -> None:
        set_kernel_timeouts(sock, timeout_s)
        self.sock = sock
        self.ids = itertools.count(1)
        self.reader = FrameReader(sock, fp.HEADER.size, lambda h: fp.Header.parse(h).length, spin_s=spin_us * 1e-6)
        self.incarnation = incarnation  # of the daemon that said HELLO on it
        self.unsettled = False  # one-way requests sent since the last reply (the daemon may not have run them yet)
        self.spares: dict[int, list[int]] = {}  # block size -> this connection's spare slots (spare_puts.py)
        self.spares_refused: dict[int, float] = {}  # block size -> when to ask for spare slots again
        self.dead = False  # dropped after a failure (FastChannel._drop): never used again


def spin_us_from_env() -> int:
    """$KVSTORE_SPIN_US (default DEFAULT_SPIN_US): how long a call polls for its reply before it sleeps."""
    raw = os.environ.get("KVSTORE_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SPIN_US:
        raise ConfigError(f"KVSTORE_SPIN_US={raw!r}: use an integer number of microseconds from 0 (never poll) to "
                          f"{MAX_SPIN_US}, or unset it for the default {DEFAULT_SPIN_US}")
    return value


class FastChannel:
    """`spin_us`: after sending, poll for the reply this long before sleeping in recv (0: sleep at once). A reply
    that lands while the caller sleeps pays a wake-up (20-30 us on a VM); most replies come within 50-300 us, and the caller would only wait for them anyway."""

    def __init__(self, path: str, token: str, timeout_s: float, spin_us: int = 0) -> None:
        self.path = path
        self.spin_us = spin_us
        self._token = token
        self._timeout = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self.incarnation = 0  # the daemon's, as the last HELLO said
        self.max_batch_keys = 0  # the most keys one request may carry, as the last HELLO said

    def _conn(self) -> FastConn:
        c: FastConn | None = getattr(self._local, "conn", None)
        if c is not None:
            return c
        c = self.dial()
        self._local.conn = c
        return c

    def dial(self) -> FastConn:
        """A new connection (HELLO done), not this thread's: for a caller that serializes its use itself
        (slot_bank.py). It closes with the channel, or when a call on it fails."""
        if self._closed:
            raise StoreUnavailableError("the client is closed")
        try:
            sock = _dial(self.path, self._timeout)
            sock.sendall(fp.frame(fp.HELLO, fp.encode_hello(self._token, want_arena=False)))
            head = fp.Header.parse(recv_exact(sock, fp.HEADER.size))
            body = recv_exact(sock, head.length)
        except (OSError, fp.FrameError) as exc:
            raise StoreUnavailableError(f"kvstore fast path {self.path} unavailable: {exc}") from exc
        if head.status != fp.OK:
            sock.close()
            _raise_error(body)
        self.incarnation, self.max_batch_keys = fp.decode_hello_reply(body)
        c = FastConn(sock, self._timeout, self.spin_us, self.incarnation)
        with self._lock:
            self._open.add(sock)
        return c

    def _drop(self, c: FastConn) -> None:
        c.dead = True
        if getattr(self._local, "conn", None) is c:
            self._local.conn = None
        with self._lock:
            self._open.discard(c.sock)
        c.sock.close()

    def call(self, op: int, body: bytes, flags: int = 0) -> bytes:
        """Send one request and return its reply body; raises the daemon's error as its KVStoreError class."""
        c = self._conn()
        rid = next(c.ids) & 0xFFFFFFFF
        c = self._send(c, fp.HEADER.pack(len(body), op, flags, fp.OK, rid) + body)
        reply = self._reply(c, rid)
        if isinstance(reply, KVStoreError):
            raise reply
        return reply

    def call_many(self, calls: Sequence[tuple[int, bytes, int]]) -> list[bytes | KVStoreError]:
        """Pipelined: every (op, body, flags) request sent at once, the replies read in order (the daemon answers
        a connection's frames one after another), so K calls cost one round trip plus the daemon's work. A
        request the daemon refuses comes back as its KVStoreError in its slot (the others stand); a broken
        connection raises StoreUnavailableError."""
        c = self._conn()
        rids, frames = [], []
        for op, body, flags in calls:
            rid = next(c.ids) & 0xFFFFFFFF
            rids.append(rid)
            frames.append(fp.HEADER.pack(len(body), op, flags, fp.OK, rid) + body)
        c = self._send(c, b"".join(frames))
        return [self._reply(c, rid) for rid in rids]

    def send_one_way(self, requests: Sequence[tuple[int, bytes, int]], incarnation: int) -> int | None:
        """Send one-way requests (fp.ONE_WAY: the daemon answers none) in one write on this thread's connection,
        if the daemon at its other end is `incarnation` (the one whose key index the caller read). Returns that
        daemon's incarnation (the requests were sent only when it is `incarnation`); None when the connection was
        found dead (the daemon restarted or closed it): nothing was sent. Never resent on a fresh connection,
        unlike a call: the caller's answer came from a daemon that is gone."""
        c = self._conn()
        if c.incarnation != incarnation:
            return c.incarnation
        frames = [fp.HEADER.pack(len(body), op, flags, fp.OK, next(c.ids) & 0xFFFFFFFF) + body
                  for op, body, flags in requests]
        try:
            c.sock.sendall(b"".join(frames))
        except OSError:
            self._drop(c)
            return None
        c.unsettled = True
        return c.incarnation

    def alive(self, c: FastConn) -> bool:
        """Whether `c` is still open (not dropped after a failure)."""
        return not c.dead

    def conn(self) -> FastConn:
        """This thread's connection (dialled if needed): what owns its spare slots (kvstore/client/spare_puts.py)."""
        return self._conn()

    def call_on(self, c: FastConn, op: int, body: bytes) -> bytes | None:
        """`call` on exactly connection `c`, never on a fresh one: what it asks names c's own spare slots. None
        when c was found dead before the send (the daemon never read the request: nothing was applied)."""
        rid = self.send_on(c, op, body)
        if rid is None:
            return None
        reply = self.reply_on(c, rid)
        if isinstance(reply, KVStoreError):
            raise reply
        return reply

    def send_on(self, c: FastConn, op: int, body: bytes) -> int | None:
        """Send one request on exactly `c` without waiting: its request id, for `reply_on`; None when c was found
        dead (nothing sent). Requests sent this way are answered in order."""
        rid = next(c.ids) & 0xFFFFFFFF
        try:
            c.sock.sendall(fp.HEADER.pack(len(body), op, 0, fp.OK, rid) + body)
        except OSError:
            self._drop(c)
            return None
        return rid

    def reply_on(self, c: FastConn, rid: int) -> bytes | KVStoreError:
        """The reply to request `rid` sent by `send_on` (the earlier ones' read first): its body or the daemon's
        error (returned); StoreUnavailableError when the connection broke."""
        return self._reply(c, rid)

    def settle(self) -> None:
        """Wait until the daemon has run this thread's one-way requests (an Echo behind them: it answers a
        connection's frames in order), so that what the caller asks next (Stats) counts them."""
        c: FastConn | None = getattr(self._local, "conn", None)
        if c is not None and c.unsettled:
            self.call(fp.ECHO, b"")

    def _send(self, c: FastConn, request: bytes) -> FastConn:
        try:
            c.sock.sendall(request)
            return c
        except OSError:
            # The connection died while idle (the daemon restarted or closed it): the daemon never read this
            # request, so sending it once more on a fresh connection cannot apply it twice.
            self._drop(c)
            c = self._conn()
            try:
                c.sock.sendall(request)
                return c
            except OSError as exc:
                self._drop(c)
                raise StoreUnavailableError(f"kvstore fast path {self.path} failed: {exc}") from exc

    def _reply(self, c: FastConn, rid: int) -> bytes | KVStoreError:
        """The reply to request `rid`: its body, or the daemon's error as a KVStoreError (returned, not raised)."""
        c.reader.spin_s = 0.0 if getattr(_thread_mode, "quiet", False) else self.spin_us * 1e-6
        try:
            raw, reply = c.reader.frame()
            head = fp.Header.parse(raw)
        except (OSError, fp.FrameError) as exc:  # BlockingIOError: the kernel's timeout (set_kernel_timeouts)
            self._drop(c)
            raise StoreUnavailableError(f"kvstore fast path {self.path} failed mid-call: {exc}") from exc
        if head.flags & fp.CLOSING or (head.request_id != rid and head.status == fp.OK):
            self._drop(c)  # the daemon closes it after this reply (or it is out of step)
            if head.status == fp.OK:
                raise StoreUnavailableError(f"fast path reply {head.request_id} to request {rid}: connection reset")
        c.unsettled = False  # the daemon ran everything sent before this request
        if head.status != fp.OK:
            reason, message = fp.decode_error(reply)
            return error_for_reason(reason)(message)
        return reply

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        with self._lock:
            socks, self._open = list(self._open), set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def __getstate__(self) -> Any:  # a channel is per process: never pickled along with a client
        raise TypeError("FastChannel cannot be pickled")
