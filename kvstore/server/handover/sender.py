"""The running daemon's side of a hand-over: wait for a successor, prove it, hand it everything, step aside.

`HandoverListener` listens on `<unix_socket>.handover` (0600, in the socket's 0700 directory) for the whole life
of the daemon and runs one session at a time on its own thread. A session (protocol.py has the messages):

    1. the caller's user must be this daemon's (or root), and it must answer the challenge (auth.py); else it
       is refused and logged, and nothing is sent;
    2. another hand-over format: the successor is of another version. The host is told to `decline` (stop as on
       SIGTERM: peers get this node's blocks, the disk tier is closed cleanly) so the successor starts cold;
    3. OFFER: the files (journal, arena files, key index tables); a DECLINE from the successor (another arena
       geometry, ...) is step 2 again;
    4. `prepare` while still serving (every journal record written, every block hashed), then the successor
       verifies them, still outside the window;
    5. `freeze`: no more requests; what is in flight finishes; the live state goes in FROZEN;
    6. READY from the successor: COMMIT; once it says SERVING (its sockets are the paths' now), `commit`: the
       host exits without closing what it handed over.
       Anything else from step 5 on (an error, EOF, a timeout of `timeout_s` on any message): ABORT, and
       `resume`: the daemon serves on as before. Before step 5, the daemon never stopped serving.

The host (kvstore/server/main.py's Daemon) implements HandoverHost.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Protocol

import numpy as np

from kvstore.fastpath.sockets import clear_stale_socket
from kvstore.server.handover import protocol as hp
from kvstore.server.handover.auth import handover_key, peer_allowed, proof_ok
from kvstore.server.handover.protocol import HandoverError, Kind

__all__ = ["HandoverHost", "HandoverListener", "Frozen"]

log = logging.getLogger(__name__)

Frozen = tuple[dict[str, Any], dict[str, np.ndarray], list[int]]


class HandoverHost(Protocol):
    def offer(self) -> tuple[dict[str, Any], list[int]]: ...   # what the successor maps: body, descriptors
    def prepare(self) -> dict[str, Any]: ...                   # journal written and hashed, still serving
    def freeze(self) -> Frozen: ...                            # stop serving; the live state and listeners
    def resume(self, why: str) -> None: ...                    # the hand-over failed after freeze: serve again
    def commit(self) -> None: ...                              # the successor serves: exit (does not return)
    def decline(self, why: str) -> None: ...                   # the successor starts cold: stop as on SIGTERM


class HandoverListener:
    def __init__(self, path: str, host: HandoverHost, tokens_file: str, timeout_s: float,
                 stage: Any = None) -> None:
        """`stage(name)`, when given, is called at each step (tests hold a side there to kill it)."""
        self.path = path
        self._host = host
        self._tokens_file = tokens_file
        self._timeout = timeout_s
        self._stage = stage or (lambda name: None)
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kept: socket.socket | None = None  # a declined successor's connection: open until this process exits
        self.refused = 0   # callers refused (another user, a failed proof)
        self.sessions = 0  # sessions that reached the challenge

    def start(self, listener: socket.socket | None = None) -> None:
        """Listen (on `listener` when given: a successor that took the path over)."""
        if listener is None:
            clear_stale_socket(self.path, "hand-over socket")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.path)
            os.chmod(self.path, 0o600)
        listener.listen(4)
        listener.settimeout(0.5)
        self._sock = listener
        self._thread = threading.Thread(target=self._loop, name="kvstore-handover", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()

    def _loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                self._session(conn)
            except Exception as exc:  # a bug in one session must not end the listener
                log.exception("hand-over session failed")
                try:
                    hp.send(conn, Kind.ERROR, {"why": f"internal error in the running daemon: {exc}"})
                except HandoverError:
                    pass
            finally:
                if conn is not self._kept:
                    conn.close()

    def _session(self, conn: socket.socket) -> None:
        conn.settimeout(self._timeout)
        allowed, pid = peer_allowed(conn)
        if not allowed:
            self._refuse(pid, "it runs as another user")
            return
        try:
            hello = hp.expect(hp.recv(conn), Kind.HELLO)
            nonce = os.urandom(32)
            hp.send(conn, Kind.CHALLENGE, {"nonce": nonce.hex()})
            answer = hp.expect(hp.recv(conn), Kind.PROOF)
            if not proof_ok(handover_key(self._tokens_file), nonce, answer.body.get("hmac")):
                self._refuse(pid, "its proof is wrong (it does not hold this daemon's tokens file)")
                hp.send(conn, Kind.ERROR, {"why": "refused: not a kvstore daemon of this node"})
                return
        except HandoverError as exc:
            self._refuse(pid, str(exc))
            return
        self.sessions += 1
        version = str(hello.body.get("version", "?"))
        log.info("hand-over: successor pid %d (version %s) connected", pid, version)
        self._stage("authenticated")
        if hello.format != hp.FORMAT:
            self._decline(conn, f"the successor (pid {pid}, version {version}) speaks hand-over format "
                          f"{hello.format}, this daemon {hp.FORMAT}")
            return
        self._offer(conn, pid)

    def _offer(self, conn: socket.socket, pid: int) -> None:
        try:
            body, fds = self._host.offer()
            hp.send(conn, Kind.OFFER, body, fds=fds)
            self._stage("offered")
            answer = hp.expect(hp.recv(conn), Kind.ACCEPT, Kind.DECLINE)
            if answer.kind == Kind.DECLINE:
                self._decline(conn, str(answer.body.get("why", "?")), answered=True)
                return
            hp.send(conn, Kind.PREPARED, self._host.prepare())
            self._stage("prepared")
            hp.expect(hp.recv(conn), Kind.VERIFIED)
        except HandoverError as exc:
            log.warning("hand-over to pid %d stopped before its window (%s): serving on", pid, exc)
            return
        self._window(conn, pid)

    def _window(self, conn: socket.socket, pid: int) -> None:
        """From the freeze on: COMMIT and exit, or ABORT and serve again."""
        try:
            body, blobs, fds = self._host.freeze()
        except Exception as exc:  # noqa: BLE001 - a freeze that failed half-way must still resume
            log.exception("hand-over freeze failed")
            self._abort(conn, f"the freeze failed: {exc}")
            return
        try:
            self._stage("frozen")
            hp.send(conn, Kind.FROZEN, body, blobs, fds)
            self._stage("sent")
            hp.expect(hp.recv(conn), Kind.READY)
        except HandoverError as exc:
            self._abort(conn, str(exc))
            return
        try:
            hp.send(conn, Kind.COMMIT, {})
        except HandoverError as exc:  # the successor died after READY: nobody would serve
            self._abort(conn, f"the successor went away before the commit ({exc})")
            return
        self._stage("committed")
        try:  # until then new gRPC connections still reach this process (its gate says: retry)
            hp.expect(hp.recv(conn), Kind.SERVING)
        except HandoverError as exc:
            log.warning("hand-over: no SERVING from pid %d after the commit (%s); exiting anyway", pid, exc)
        log.info("hand-over: pid %d serves now; this daemon exits", pid)
        self._stop.set()  # no session after this one: the successor listens on the path next
        if self._sock is not None:
            self._sock.close()
        self._host.commit()

    def _abort(self, conn: socket.socket, why: str) -> None:
        log.warning("hand-over aborted (%s): this daemon serves on", why)
        try:
            hp.send(conn, Kind.ABORT, {"why": why})
        except HandoverError:
            pass
        self._host.resume(why)

    def _decline(self, conn: socket.socket, why: str, answered: bool = False) -> None:
        log.warning("hand-over declined: %s; stopping as on SIGTERM so that the successor starts cold", why)
        if not answered:
            try:
                hp.send(conn, Kind.DECLINE, {"why": why})
            except HandoverError:
                pass
        self._kept = conn  # its EOF tells the successor this process is gone
        self._host.decline(why)

    def _refuse(self, pid: int, why: str) -> None:
        self.refused += 1
        log.warning("refused a hand-over from pid %d: %s", pid, why)
