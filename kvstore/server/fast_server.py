"""The daemon's same-node socket: hands out arena files and answers the fast path's hot operations.

One unix socket, `<unix_socket>.arena`, mode 0600 beside the gRPC socket. A connection starts with HELLO
(kvstore/fastpath/protocol.py): the token is checked (the same table as the gRPC interceptor, reloaded in place),
and the reply carries the daemon's incarnation and, if asked, the caller's arena file as an SCM_RIGHTS
descriptor (kvstore/arena: with tokens, the token's tenant's file; without, the shared one). Then requests:
each decoded, run through the same ControlOps as gRPC (ops.py: tenant checks, engine, arena windows) in this
connection's thread with the caller's tenant set, observed in the same RPC histogram, answered in order.

Bounds and failures:
- HELLO must arrive whole within `hello_timeout_s` of the connection; a request frame, once its header arrived,
  within `frame_timeout_s`. An idle connection (between frames) waits as long as the client keeps it.
- At most `max_connections` at once (one thread each); beyond, a new connection gets an UNAVAILABLE error
  frame and is closed (the client then uses gRPC).
- A tokens_file reload closes every connection of a revoked token (drop_revoked), idle or not; the token is
  also checked again on every request (a request that slips in before the close: UNAUTHENTICATED, closed).
- A connection may hold spare slots (SPARE, STORE: kvstore/engine/spares.py); when it closes, for whatever
  reason, its slots go to the quarantine (a thread of that client may still be copying into one).
- Between frames the thread sleeps in recv, except while its client's frames come close together: then it
  polls for the next one for up to `spin_us` (ServerConfig.fast_spin_us; Spinner; at most one polling thread
  per 8 CPUs).
- A Commit or Store answers before the watermark eviction it sets off: the thread runs that right after sending
  the reply (ControlOps.settle; kvstore/engine/engine_lock.py), or any other call that takes the engine's lock
  first runs it before its own work.
- A frame that breaks the format gets an invalid_request error frame and the connection is closed (the stream
  may be out of step); a KVStoreError is an error frame and the connection goes on; EOF mid-frame just closes.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from kvstore.arena.backing import SHARED_DOMAIN, ArenaBacking
from kvstore.engine.key_mirror import KeyIndexMirror
from kvstore.engine.results import LookupResult
from kvstore.counters import CounterSet
from kvstore.errors import ConfigError, KVStoreError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath import spare_bodies as sb
from kvstore.fastpath.sockets import DAEMON_SPIN_US, FrameReader, recv_exact
from kvstore.server.auth import current_tenant
from kvstore.server.fast_acceptor import Acceptor
from kvstore.server.ops import ControlOps

__all__ = ["FastServer", "FastCounters", "Spinner", "fast_socket_path"]

def _default_spinners() -> int:
    """How many connection threads may poll at once: one per 8 CPUs (at least one), so that polling never
    takes more than a small share of the node from the model's own processes."""
    return max(1, (os.cpu_count() or 1) // 8)


class Spinner:
    """A connection's wait for its next frame: poll (FrameReader.spin_s) instead of sleeping in recv, but only
    while this client sends its frames close together (a put's Commit after its copy, a Release after a get, a
    burst of probes) and only when one of the daemon's few polling slots is free. A client calling now and then
    costs no CPU; a burst saves the wake-up from sleep (20-30 us on a VM) on each of its frames."""

    __slots__ = ("spin_s", "_slots", "_close")

    def __init__(self, spin_s: float, slots: threading.BoundedSemaphore) -> None:
        self.spin_s = spin_s
        self._slots = slots
        self._close = False  # did the last frame come within spin_s of the previous reply?

    def frame(self, reader: FrameReader) -> tuple[bytes, bytes]:
        polling = self._close and self._slots.acquire(blocking=False)
        reader.spin_s = self.spin_s if polling else 0.0
        idle_from = time.perf_counter()
        try:
            out = reader.frame()
        finally:
            if polling:
                self._slots.release()
        self._close = self.spin_s > 0 and time.perf_counter() - idle_from <= self.spin_s
        return out

log = logging.getLogger(__name__)


class FastCounters(CounterSet):
    """The socket's counters, under the names Stats.control and the metrics give them (ControlPlaneStats)."""

    __slots__ = ("fast_requests",      # fast-path requests answered (errors included)
                 "fast_refused",       # connections refused (bad hello, bad token, full)
                 "fast_frame_errors",  # connections closed for a malformed frame
                 "arena_files_handed")
    LOCKED = True


def fast_socket_path(unix_socket: str) -> str:
    """Where the daemon listens for arena requests and fast-path calls: beside its gRPC socket."""
    return unix_socket + ".arena" if unix_socket else ""


class FastServer:
    """`tenant_of(token)` -> tenant or None when unknown; pass None itself when tokens are off."""

    def __init__(self, path: str, backing: ArenaBacking, ops: ControlOps, incarnation: int, max_batch_keys: int,
                 tenant_of: Callable[[str], str | None] | None,
                 observe: Callable[[str, float], None] = lambda method, seconds: None, *,
                 hello_timeout_s: float = 2.0, frame_timeout_s: float = 5.0, max_connections: int = 256,
                 spin_us: int = DAEMON_SPIN_US, key_index: KeyIndexMirror | None = None) -> None:
        self.path = path
        self._key_index = key_index
        self._backing = backing
        self._ops = ops
        self._incarnation = incarnation
        self._max_batch_keys = max_batch_keys
        self._tenant_of = tenant_of
        self._observe = observe
        self._hello_timeout = hello_timeout_s
        self._frame_timeout = frame_timeout_s
        self._max_connections = max_connections
        self._spin_s = spin_us * 1e-6
        self._spinners = threading.BoundedSemaphore(_default_spinners())
        self._acceptor = Acceptor(path, self._accepted)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._tokens: dict[socket.socket, str] = {}  # open connections past HELLO -> their token
        self._owners = itertools.count(1)
        self.counters = FastCounters()  # bumped from the connection threads: add() takes the set's lock

    def drop_revoked(self) -> None:
        """After a tokens_file reload: close every connection whose token no longer names a tenant, idle or not.
        Its thread's recv ends; the client's next send fails, it dials again and its HELLO is refused. Without
        this an idle connection would learn of the revocation only at its next request, and a client answering
        probes from its key index (one-way HITS) sends requests it never reads a reply to."""
        if self._tenant_of is None:
            return
        with self._lock:
            revoked = [c for c, token in self._tokens.items() if not self._tenant_of(token)]
        for c in revoked:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if revoked:
            log.info("closed %d fast-path connection(s) whose token was revoked", len(revoked))

    @property
    def connections(self) -> int:
        return len(self._conns)

    def status(self) -> dict[str, int]:
        """Counters for Stats (ControlPlaneStats) and metrics."""
        return {"fast_connections": len(self._conns), **self.counters.snapshot()}

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self, listener: socket.socket | None = None) -> None:
        """Listen on the path, or on `listener`: the same socket a predecessor listened on (a hand-over), so
        clients dialling it meanwhile wait in its backlog instead of being refused."""
        self._acceptor.start(listener)

    @property
    def listener(self) -> socket.socket | None:
        return self._acceptor.sock

    def pause(self, timeout_s: float) -> int:
        """A hand-over's freeze: stop accepting (the listener stays open, for the successor); let each connection
        finish the requests it has read, then close (shutdown(SHUT_RD): its client's next send fails, so that
        request was never read and the client sends it again on a new connection, which waits in the
        backlog for the successor). Returns the connections still open after timeout_s."""
        self._acceptor.pause()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while self._conns and time.monotonic() < deadline:
            time.sleep(0.002)
        return len(self._conns)

    def resume(self) -> None:
        """The hand-over failed: accept again on the same listener."""
        self._acceptor.resume()

    def stop(self) -> None:
        self._stopping.set()
        self._acceptor.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # wakes their threads: recv returns EOF
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accepted(self, conn: socket.socket) -> None:
        """A new connection: its own thread, unless max_connections are open (an error frame, closed)."""
        with self._lock:
            full = len(self._conns) >= self._max_connections
            if not full:
                self._conns.add(conn)
        if full:
            self.counters.add("fast_refused")
            _send_error(conn, 0, fp.HELLO, "unavailable", f"{self._max_connections} fast-path connections "
                        "already: use gRPC (the client does so by itself)")
            conn.close()
            return
        threading.Thread(target=self._serve, args=(conn,), name="kvstore-fast-conn", daemon=True).start()

    # -- one connection -----------------------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        owner = next(self._owners)  # this connection, as the holder of spare slots (kvstore/engine/spares.py)
        try:
            token = self._hello(conn)
            if token is not None:
                with self._lock:
                    self._tokens[conn] = token
                self._requests(conn, token, owner)
        except OSError:  # ConnectionError too: the client went away
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._tokens.pop(conn, None)
            conn.close()
            self._ops.drop_spares(owner)  # quarantined: a thread of that client may still copy into one

    def _hello(self, conn: socket.socket) -> str | None:
        """The caller's token when the hello was accepted (the reply is sent); None when refused."""
        conn.settimeout(self._hello_timeout)
        try:
            head = fp.Header.parse(recv_exact(conn, fp.HEADER.size))
            if head.op != fp.HELLO:
                raise fp.FrameError("the first frame must be HELLO")
            token, wants = fp.decode_hello(recv_exact(conn, head.length))
        except (fp.FrameError, TimeoutError) as exc:
            self.counters.add("fast_refused")
            if not isinstance(exc, TimeoutError):
                _send_error(conn, 0, fp.HELLO, "invalid_request", str(exc))
            return None
        domain = SHARED_DOMAIN
        if self._tenant_of is not None:
            tenant = self._tenant_of(token) if token else None
            if not tenant:
                why = "missing bearer token" if not token else "invalid bearer token (not in the daemon's tokens_file)"
                log.warning("refused a fast-path connection: %s", why)
                self.counters.add("fast_refused")
                _send_error(conn, head.request_id, fp.HELLO, "unauthenticated", why)
                return None
            domain = tenant
            current_tenant.set(tenant)  # this thread serves only this caller
        reply = fp.frame(fp.HELLO, fp.encode_hello_reply(self._incarnation, self._max_batch_keys), head.request_id)
        if wants & fp.HELLO_WANT_INDEX:
            self._hand_index(conn, head.request_id, domain, reply)
            return None
        if wants & fp.HELLO_WANT_ARENA:
            try:
                fd = self._backing.file_of(domain).fd
            except (OSError, ConfigError) as exc:
                _send_error(conn, head.request_id, fp.HELLO, "unavailable", f"cannot create the arena file: {exc}")
                return None
            socket.send_fds(conn, [reply], [fd])
            self.counters.add("arena_files_handed")
        else:
            conn.sendall(reply)
        return token

    def _hand_index(self, conn: socket.socket, request_id: int, domain: str, reply: bytes) -> None:
        """The caller's tenant's shared key index, read-only, over SCM_RIGHTS; an error when the daemon runs
        without one (key_index_entries = 0). A one-shot exchange: the connection closes after it."""
        if self._key_index is None:
            _send_error(conn, request_id, fp.HELLO, "unavailable", "the daemon runs without a shared key index "
                        "(key_index_entries = 0): probes go to the daemon")
            return
        try:
            fd = self._key_index.reader_fd(domain)
        except OSError as exc:
            _send_error(conn, request_id, fp.HELLO, "unavailable", f"cannot open the key index: {exc}")
            return
        try:
            socket.send_fds(conn, [reply], [fd])
        finally:
            os.close(fd)

    def _requests(self, conn: socket.socket, token: str, owner: int) -> None:
        # idle between frames as long as the client keeps the connection; a frame's rest within frame_timeout
        conn.settimeout(None)
        reader = FrameReader(conn, fp.HEADER.size, lambda h: fp.Header.parse(h).length, self._frame_timeout)
        spin = Spinner(self._spin_s, self._spinners)
        held: list[bytes] = []  # replies not sent yet: the next request was already buffered (pipelined)
        while not self._stopping.is_set():
            try:
                raw, body = spin.frame(reader)
                head = fp.Header.parse(raw)
            except fp.FrameError as exc:
                self.counters.add("fast_frame_errors")
                _send_error(conn, 0, 0, "invalid_request", f"bad frame: {exc}", before=held)
                return
            except TimeoutError:
                self.counters.add("fast_frame_errors")
                return
            if self._tenant_of is not None and not self._tenant_of(token):
                _send_error(conn, head.request_id, head.op, "unauthenticated",
                            "the bearer token of this connection was revoked (tokens_file changed)", before=held)
                return
            if not self._answer(conn, head, body, held, reader.frame_buffered(), owner):
                return

    def _answer(self, conn: socket.socket, head: fp.Header, body: bytes, held: list[bytes], more: bool,
                owner: int) -> bool:
        """Run one request and send its reply; False when the connection must close (a malformed body). With
        `more` (the next request is already here) the reply waits in `held`, to leave with the next ones in one
        write: K pipelined requests (a TP 8 probe: one per rank) cost one send, and the client one wake-up.
        A one-way request (fp.ONE_WAY) gets no reply; its refusal is logged (the client does not wait for it)."""
        name = fp.OP_NAMES[head.op]
        one_way = head.op in fp.ONE_WAY
        t0 = time.perf_counter()
        keep = True
        try:
            reply = self._dispatch(head, body, owner)
            out = b"" if one_way else fp.frame(head.op, reply, head.request_id)
        except KVStoreError as exc:
            out = b"" if one_way else _error_frame(head.request_id, head.op, exc.reason, exc.message)
            if one_way:
                log.warning("refused a one-way fast-path %s: %s", name, exc.message)
        except fp.FrameError as exc:  # the stream may be out of step: an error frame and close, one-way or not
            self.counters.add("fast_frame_errors")
            out, keep = _error_frame(head.request_id, head.op, "invalid_request", f"bad {name} frame: {exc}",
                                     closing=True), False
        except Exception:  # a bug must not take the connection thread down silently
            log.exception("internal error in fast-path %s", name)
            out = b"" if one_way else _error_frame(head.request_id, head.op, "internal",
                                                   f"internal error in {name}; see the daemon log")
        self.counters.add("fast_requests")
        if out:
            held.append(out)
        if held and (not more or not keep):
            conn.sendall(b"".join(held) if len(held) > 1 else held[0])
            held.clear()
        self._observe(name, time.perf_counter() - t0)  # after the reply: the client is not kept waiting for it
        if not held:
            self._ops.settle()  # what a Commit or Store left for after its reply (settle_later)
        return keep

    def _dispatch(self, head: fp.Header, body: bytes, owner: int) -> bytes:
        ops, op = self._ops, head.op
        if op == fp.LOOKUP:
            ns, keys = fp.decode_lookup(body)
            r = ops.lookup(ns, keys, bool(head.flags & fp.LOOKUP_PREFIX), bool(head.flags & fp.LOOKUP_LEASE),
                           summary=bool(head.flags & fp.LOOKUP_SUMMARY))
            return self._lookup_reply(r)
        if op == fp.RESERVE:
            ns, keys, sizes = fp.decode_reserve(body)
            res = ops.reserve(ns, keys, sizes)
            return fp.encode_reserve_reply(res.reservation_id, res.expires_in_ms, self._incarnation, res.outcomes,
                                           res.offsets)
        if op == fp.COMMIT:
            rid, checksums = fp.decode_commit(body)
            return fp.encode_count(ops.commit(rid, checksums, settle_later=True))
        if op == fp.ABORT:
            return fp.encode_count(ops.abort(fp.decode_u64(body)))
        if op == fp.RELEASE:
            return fp.encode_count(ops.release(fp.decode_release(body)))
        if op == fp.EXISTS:
            ns, keys = fp.decode_exists(body)
            return fp.encode_bools(ops.exists(ns, keys, cluster=bool(head.flags & fp.EXISTS_CLUSTER)))
        if op == fp.LOOKUP_IDS:
            ns, ids, serials, keys = fp.decode_probe(body)
            if keys:
                raise fp.FrameError(f"a Lookup by entry ids carries {len(keys)} keys")
            found = ops.lookup_entries(ns, ids, serials, bool(head.flags & fp.LOOKUP_PREFIX),
                                       bool(head.flags & fp.LOOKUP_LEASE), bool(head.flags & fp.LOOKUP_SUMMARY))
            return self._lookup_reply(found) if found is not None else b""
        if op == fp.PROBE:
            ns, ids, serials, tail = fp.decode_probe(body)
            r = ops.probe(ns, ids, serials, tail)
            return fp.encode_probe_reply(r.num_prefix, r.tiers, self._incarnation)
        if op == fp.HITS:  # a Lookup the client answered from the index: its effects, no reply
            ns, ids, serials, keys = fp.decode_probe(body)
            read = bool(head.flags & fp.HITS_READ)
            if (not len(ids) and not keys) or (read and keys):
                raise fp.FrameError(f"a hits note names {len(ids)} entries and carries {len(keys)} keys"
                                    + (" with HITS_READ (ids only)" if read and keys else ""))
            ops.probe(ns, ids, serials, keys, read=read)
            return b""
        if op == fp.SPARE:
            slot_bytes, offsets = ops.spare(owner, *sb.decode_spare(body))
            return sb.encode_spare_reply(slot_bytes, offsets)
        if op == fp.STORE:
            s = ops.store(owner, *sb.decode_store(body), settle_later=True)
            return sb.encode_store_reply(s.stored, s.outcomes, s.refill)
        if op == fp.ECHO:
            if len(body) > fp.MAX_ECHO:
                raise fp.FrameError(f"echo of {len(body)} bytes (at most {fp.MAX_ECHO})")
            return body
        raise fp.FrameError("HELLO again on an open connection")


    def _lookup_reply(self, r: LookupResult) -> bytes:
        c = r.columns  # the engine's numpy columns: bytes without packing its lists again
        if c is not None:
            return fp.encode_lookup_reply(r.num_prefix, r.present, r.tiers, r.lease_id, r.expires_in_ms,
                                          self._incarnation, c.offsets, c.sizes, c.generations, c.checksums)
        return fp.encode_lookup_reply(r.num_prefix, r.present, r.tiers, r.lease_id, r.expires_in_ms,
                                      self._incarnation, r.offsets, r.sizes, r.generations, r.checksums)


def _error_frame(request_id: int, op: int, reason: str, message: str, closing: bool = False) -> bytes:
    return fp.frame(op or fp.HELLO, fp.encode_error(reason, message), request_id, status=fp.ERROR,
                    flags=fp.CLOSING if closing else 0)


def _send_error(conn: socket.socket, request_id: int, op: int, reason: str, message: str,
                before: list[bytes] | None = None) -> None:
    """An error after which the connection is closed (after the replies still `before` it, in order)."""
    try:
        conn.sendall(b"".join(before or ()) + _error_frame(request_id, op, reason, message, closing=True))
    except OSError:
        pass
