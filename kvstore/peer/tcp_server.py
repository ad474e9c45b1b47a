"""The TCP plane's listener: one thread per connection, frames served one at a time, every wait bounded.

    accepted ─(TLS handshake, bounded by timeout_s)─> idle ─(first header byte)─> busy ─(frame served)─> idle
       │                                               │                            │
       └── listener full: the longest-idle is evicted  ├── idle_timeout_s: closed   └── frame deadline: closed,
           (conn_table.py); all busy: refused          │   (idle_closed)                reservation aborted
                                                       └── evicted (idle_evicted)       (frame_deadline_exceeded)

A request frame (header, metadata and every block's bytes) must arrive in full within timeout_s of its first
byte: one Deadline per frame, re-armed before every recv (deadline.py), so a peer trickling bytes is cut off
at the deadline rather than kept alive by each byte. Bytes of a PUSH land in reserved arena slots only while
the reservation is safely alive (tcp_blocks.py). A reply is sent within its own timeout_s (and, for a fetch,
within the lease on the blocks it sends). What a frame means and what to answer is protocol.py's (parse_request,
serve); this file moves the bytes. A frame that breaks the format (frames.FrameError) or stops short
(peer closed) closes the connection and counts `frame_errors`; the daemon keeps serving everyone else.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

from kvstore.errors import ConfigError
from kvstore.peer import frames as fr
from kvstore.peer import protocol as proto
from kvstore.peer.conn_table import Conn, ConnTable
from kvstore.peer.counters import PeerCounters
from kvstore.peer.deadline import Deadline, DeadlineExceeded
from kvstore.peer.frames import FrameError
from kvstore.peer.local import LocalStore
from kvstore.peer.sockio import ConnectionClosed, recv_exact, send_all, tune
from kvstore.peer.tcp_blocks import receive_blocks, send_blocks
from kvstore.transfers import TransferMeter

__all__ = ["TcpServer", "MAX_CONNECTIONS"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64


class TcpServer:
    def __init__(self, local: LocalStore, counters: PeerCounters, meter: TransferMeter, *, listen: str,
                 timeout_s: float, idle_timeout_s: float, max_keys: int, max_block_bytes: int,
                 context: ssl.SSLContext | None = None, max_connections: int = MAX_CONNECTIONS) -> None:
        if idle_timeout_s <= 0:
            raise ConfigError(f"peer idle timeout {idle_timeout_s}s: use a positive number of seconds")
        self._local = local
        self._counters = counters
        self._meter = meter
        self._listen = listen
        self._timeout = timeout_s
        self._idle_timeout = idle_timeout_s
        self._limits = proto.Limits(max_keys, max_block_bytes)
        self._ctx = context
        self.conns = ConnTable(max_connections, counters)
        self._server: socket.socket | None = None
        self._stopping = threading.Event()
        self.bound = ""

    def start(self) -> None:
        host, _, port = self._listen.rpartition(":")
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((host, int(port)))
        except OSError as exc:
            srv.close()
            raise ConfigError(f"cannot listen for peers on {self._listen}: {exc.strerror}; choose another peer_listen") from exc
        srv.listen(128)
        self.bound = f"{host}:{srv.getsockname()[1]}"
        self._server = srv
        threading.Thread(target=self._accept_loop, name="kvstore-peer-accept", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        self.conns.close_all()

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stopping.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            conn = self.conns.admit(sock)
            if conn is None:
                log.warning("peer data connection refused: %d connections, all mid-frame", self.conns.limit)
                sock.close()
                continue
            tune(sock)
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-peer-conn", daemon=True).start()

    def _handshake(self, conn: Conn) -> bool:
        """Mutual TLS within timeout_s (one deadline for the whole handshake); False when it failed (counted)."""
        assert self._ctx is not None
        try:
            Deadline(self._timeout, "TLS handshake").arm(conn.sock)
            tls = self._ctx.wrap_socket(conn.sock, server_side=True)  # do_handshake keeps one deadline
        except (ssl.SSLError, OSError, DeadlineExceeded) as exc:
            if not conn.evicted:
                self._counters.add("tls_handshake_failures")
                log.warning("peer data connection refused at the TLS handshake: %s", exc)
            return False
        if not self.conns.swap(conn, tls):
            tls.close()
            return False
        return True

    def _wait_header(self, conn: Conn) -> bytes | None:
        """The first bytes of the next frame, or None: closed by the peer, evicted, or idle too long."""
        try:
            Deadline(self._idle_timeout, "idle connection").arm(conn.sock)
            first = conn.sock.recv(fr.HEADER.size)
        except TimeoutError:
            self._counters.add("idle_closed")
            log.info("peer data connection closed after %.3gs idle", self._idle_timeout)
            return None
        except OSError:
            if conn.evicted or self._stopping.is_set():
                return None
            raise
        return first or None

    def _serve(self, conn: Conn) -> None:
        try:
            if self._ctx is not None and not self._handshake(conn):
                return
            while not self._stopping.is_set():
                first = self._wait_header(conn)
                if first is None or not self.conns.busy(conn):
                    return
                self._frame(conn.sock, first, Deadline(self._timeout, "request frame"))
                self.conns.idle(conn)
        except DeadlineExceeded as exc:
            self._counters.add("frame_deadline_exceeded")
            log.warning("peer data connection closed: %s", exc)
        except (FrameError, ConnectionClosed) as exc:
            self._counters.add("frame_errors")
            log.warning("peer data connection closed: %s", exc)
        except OSError as exc:
            if not self._stopping.is_set() and not conn.evicted:
                log.info("peer data connection ended: %s", exc)
        except Exception:  # a bug must cost one connection, not the daemon
            log.exception("peer data connection failed")
        finally:
            self.conns.remove(conn)
            conn.sock.close()

    def _frame(self, sock: socket.socket, first: bytes, frame: Deadline) -> None:
        """Read the rest of one request frame (all of it before `frame`'s deadline) and answer it; what to
        answer is the protocol's (protocol.serve), this only moves the bytes."""
        short = fr.HEADER.size - len(first)
        h = proto.parse_request(first + (recv_exact(sock, short, frame) if short else b""), self._limits)
        meta = recv_exact(sock, h.meta_len, frame)
        start = time.perf_counter()
        served = proto.serve(h, meta, self._local, self._limits)
        if isinstance(served, proto.Intake):
            stored = receive_blocks(sock, self._local, self._counters, served.plan, frame)
            self._counters.add(served.counter, stored)
            self._meter.observe("tcp", "peer", "in", h.payload_len, time.perf_counter() - start)
            send_all(sock, served.reply(stored).pack(), Deadline(self._timeout, "push reply"))
            return
        try:
            reply = Deadline(self._timeout, proto.OP_NAMES[served.frame.header.op])
            send_all(sock, served.frame.pack(), reply)
            if served.blocks is not None:
                send_blocks(sock, served.blocks, reply)
        finally:
            served.close()
        if served.blocks is not None:
            self._counters.add("served_blocks", served.served_blocks)
            self._meter.observe("tcp", "peer", "out", served.payload_bytes, time.perf_counter() - start)
