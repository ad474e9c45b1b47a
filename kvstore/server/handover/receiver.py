"""The successor's side of a hand-over (`kvstore-server --take-over`): take the files, check them, take over.

    TakeOver.connect(path)   None when no daemon answers there: the successor starts cold (nothing to take)
    receive()                HELLO .. FROZEN (protocol.py): an Inherited to build the daemon from; or None to
                             start cold: a version or arena geometry this daemon cannot read (the line it logs
                             says why; the running daemon then stops as on SIGTERM, and this waits for it)
    ready(blocks)            READY, then COMMIT: True, serve; ABORT: TakeOverFailed (the running daemon serves)
    predecessor_gone(s)      wait until the old process has exited (its end of the connection closes)

What happens when the other side dies (tests/test_handover_kills.py): before FROZEN the running daemon never
stopped serving, so a hand-over that fails there is a TakeOverFailed, unless the daemon's process is gone (its
end closed without a word: it always answers a refusal). Then this one starts from what it has: the arena and
journal if the OFFER came (a new incarnation; every record verified as after a crash), else cold with the disk
tier. After FROZEN the daemon waits for READY; if it dies then, this one serves what it was handed.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from kvstore._version import __version__
from kvstore.arena.layout import ArenaLayout
from kvstore.server.handover import protocol as hp
from kvstore.server.handover.auth import handover_key, proof
from kvstore.server.handover.codec import decode_live, decode_origins, decode_sessions
from kvstore.server.handover.holds import stage_hook
from kvstore.server.handover.inherit import Inherited, open_arena, verified_entries
from kvstore.server.handover.protocol import HandoverError, Kind, PeerGone

__all__ = ["TakeOver", "TakeOverFailed", "Wanted"]

log = logging.getLogger(__name__)


class TakeOverFailed(Exception):
    """The running daemon serves on (it refused, aborted or stopped answering): this process must not serve."""


class Wanted:
    """What this daemon would build; an OFFER must match it to be taken (else: start cold, saying why)."""

    def __init__(self, layout: ArenaLayout, isolated: bool, key_index_entries: int, tokens_file: str,
                 lock: str) -> None:
        self.layout, self.isolated, self.key_index_entries = layout, isolated, key_index_entries
        self.tokens_file, self.lock = tokens_file, lock


class TakeOver:
    def __init__(self, sock: socket.socket, wanted: Wanted, timeout_s: float) -> None:
        self._sock = sock
        self._wanted = wanted
        self._timeout = timeout_s
        self._stage = stage_hook("receiver")
        self.inherited: Inherited | None = None

    @classmethod
    def connect(cls, path: str, wanted: Wanted, timeout_s: float) -> TakeOver | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            log.info("take-over: no daemon answers on %s (%s): starting cold", path, exc.strerror or exc)
            return None
        return cls(sock, wanted, timeout_s)

    # -- HELLO .. FROZEN --------------------------------------------------------------------------------------
    def receive(self) -> Inherited | None:
        try:
            return self._receive()
        except PeerGone as exc:
            return self._orphaned(str(exc))
        except hp.Refused as exc:
            self._drop()
            raise TakeOverFailed(str(exc)) from exc
        except HandoverError as exc:
            self._drop()
            raise TakeOverFailed(f"the hand-over stopped: {exc}; the running daemon keeps serving") from exc

    def _receive(self) -> Inherited | None:
        w, sock = self._wanted, self._sock
        hp.send(sock, Kind.HELLO, {"version": __version__, "pid": os.getpid()})
        challenge = hp.expect(hp.recv(sock), Kind.CHALLENGE, Kind.DECLINE)
        if challenge.kind == Kind.DECLINE:
            self._cold(str(challenge.body.get("why")))
            return None
        nonce = bytes.fromhex(str(challenge.body.get("nonce", "")))
        hp.send(sock, Kind.PROOF, {"hmac": proof(handover_key(w.tokens_file), nonce)})
        offer = hp.expect(hp.recv(sock), Kind.OFFER, Kind.DECLINE)
        if offer.kind == Kind.DECLINE:
            self._cold(str(offer.body.get("why")))
            return None
        self._stage("offered")
        why = self._mismatch(offer.body)
        if why:
            offer.close_fds()
            hp.send(sock, Kind.DECLINE, {"why": why})
            self._cold(why)
            return None
        self.inherited = self._map(offer)
        if self.inherited.arena is None:
            why = self.inherited.why
            hp.send(sock, Kind.DECLINE, {"why": why})
            self._cold(why)
            return None
        hp.send(sock, Kind.ACCEPT, {})
        self._stage("accepted")
        hp.expect(hp.recv(sock), Kind.PREPARED)
        t0 = time.monotonic()
        _, v, _, _ = verified_entries(self.inherited.arena, owner=False)
        self.inherited.known = v.passed
        log.info("take-over: %d blocks (%d bytes) verified before the window in %.3fs", v.hashed_blocks,
                 v.hashed_bytes, time.monotonic() - t0)
        hp.send(sock, Kind.VERIFIED, {"blocks": len(v.passed)})
        self._stage("verified")
        frozen = hp.expect(hp.recv(sock), Kind.FROZEN)
        self._stage("frozen")
        self._take_frozen(frozen)
        return self.inherited

    def _mismatch(self, body: dict[str, Any]) -> str:
        """Why this daemon cannot take the offer ('' when it can)."""
        w = self._wanted
        lay = body.get("layout") or {}
        mine = {"n_slabs": w.layout.n_slabs, "slab_bytes": w.layout.slab_bytes, "page_bytes": w.layout.page_bytes}
        theirs = {k: lay.get(k) for k in mine}
        if theirs != mine:
            return (f"the running daemon's arena is {theirs['n_slabs']} slabs of {theirs['slab_bytes']} bytes, this "
                    f"one's {mine['n_slabs']} of {mine['slab_bytes']} (arena_bytes or max_block_bytes changed)")
        if bool(body.get("isolated")) != w.isolated:
            return "tokens_file was added or removed (one arena file versus one per tenant)"
        return ""

    def _map(self, offer: hp.Message) -> Inherited:
        """The offered files mapped (arena, journal) or kept (key index tables), by the names the body gives."""
        names = offer.body.get("files")
        fds = list(offer.fds)
        offer.fds = []
        inh = Inherited("hand-over")
        if not isinstance(names, list) or len(names) != len(fds):
            for fd in fds:
                os.close(fd)
            inh.why = "the offer's files do not match their names"
            return inh
        arena: dict[str, int] = {}
        journal = -1
        for (kind, domain), fd in zip(names, fds):
            if kind == "journal" and journal < 0:
                journal = fd
            elif kind == "arena" and isinstance(domain, str) and domain not in arena:
                arena[domain] = fd
            elif kind == "index" and isinstance(domain, str) and domain not in inh.index_fds:
                inh.index_fds[domain] = fd
            else:
                os.close(fd)
        w = self._wanted
        inh.arena, inh.why = open_arena(w.layout, journal, arena, isolated=w.isolated, lock=w.lock)
        capacity = offer.body.get("index_capacity")
        inh.index_capacity = capacity if isinstance(capacity, int) else 0
        inh.incarnation = int(offer.body.get("incarnation") or 0)
        inh.extra["index_entries"] = offer.body.get("index_entries")
        return inh

    def _take_frozen(self, frozen: hp.Message) -> None:
        inh = self.inherited
        assert inh is not None
        body = frozen.body
        inh.live = decode_live(body.get("live") or {}, frozen.blobs)
        inh.sessions = decode_sessions(body.get("sessions") or [])
        inh.kv_origins = decode_origins(body.get("kv_origins") or [], frozen.blobs.get("origin_tokens"))
        lease = body.get("peer_lease")
        inh.peer_lease = lease if isinstance(lease, int) and lease > 0 else 0
        fds = list(frozen.fds)
        frozen.fds = []
        if len(fds) == 1:
            inh.fast_listener = socket.socket(fileno=fds[0])
        else:
            for fd in fds:
                os.close(fd)

    # -- READY .. COMMIT -------------------------------------------------------------------------------------
    def ready(self, blocks: int) -> None:
        """Tell the running daemon this one can serve; return once it stepped aside (COMMIT, or its process is
        gone); TakeOverFailed when it aborted (it serves on: this one must not)."""
        self._stage("adopted")
        try:
            hp.send(self._sock, Kind.READY, {"blocks": blocks})
            hp.expect(hp.recv(self._sock), Kind.COMMIT)
        except PeerGone:
            log.warning("take-over: the running daemon died before its commit; serving what it handed over")
        except HandoverError as exc:
            self._drop()
            raise TakeOverFailed(f"the running daemon kept serving: {exc}") from exc
        self._stage("committed")

    def serving(self) -> None:
        """This daemon serves on the paths now: the old one may exit."""
        try:
            hp.send(self._sock, Kind.SERVING, {})
        except HandoverError:
            pass

    def predecessor_gone(self, timeout_s: float) -> bool:
        """Wait until the old process has exited (its end of the connection closes); False after timeout_s."""
        self._sock.settimeout(timeout_s)
        try:
            while self._sock.recv(4096):
                pass
            return True
        except TimeoutError:
            return False
        except OSError:
            return True
        finally:
            self._drop()

    # -- failures ---------------------------------------------------------------------------------------------
    def _cold(self, why: str) -> None:
        """Start cold: the running daemon stops as on SIGTERM for it; wait for its process to be gone."""
        log.warning("take-over: starting cold: %s", why)
        if self.inherited is not None:
            self._release(self.inherited)
            self.inherited = None
        if not self.predecessor_gone(max(self._timeout, 120.0)):
            raise TakeOverFailed("the running daemon did not stop after declining the hand-over")

    def _orphaned(self, why: str) -> Inherited | None:
        """The running daemon died mid-way (no word): start from the arena if it came (verified as after a crash:
        no live state, a new incarnation), else cold."""
        self._drop()
        inh = self.inherited
        if inh is None or inh.arena is None:
            log.warning("take-over: the running daemon died before handing anything over (%s): starting cold", why)
            return None
        log.warning("take-over: the running daemon died mid-way (%s): serving the arena it handed over, every "
                    "block verified again", why)
        for fd in inh.index_fds.values():
            os.close(fd)
        inh.index_fds = {}
        inh.incarnation = 0
        inh.live = None
        inh.known = {}
        inh.source = "hand-over (the old daemon died mid-way)"
        if inh.fast_listener is not None:
            inh.fast_listener.close()
            inh.fast_listener = None
        return inh

    @staticmethod
    def _release(inh: Inherited) -> None:
        inh.close_unused()
        if inh.arena is not None:
            inh.arena.destroy(unmap=True)
            inh.arena = None

    def _drop(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
