"""The running daemon's part in a hand-over (handover/sender.py's HandoverHost), a base class of main.py's Daemon.

    offer    the journal, every arena file and the key index tables, described (layout, names, incarnation)
    prepare  while serving: every committed block's journal record written, blocks without an xxh3 hashed
    freeze   the window opens: the same-node socket stops accepting and each connection finishes what it read
             (handover/../fast_server.py pause), gRPC's gate refuses new calls as `restarting` and the calls in
             flight finish (gate.py), the sweeper and journal threads stop, the disk threads finish their batch
             and promotions (queued writes are left: the successor queues what the disk lacks), the engine is
             frozen (no other thread may change it: a peer's push gets UNAVAILABLE), the last records are
             written, the live state exported, the disk tier closed (its lock goes to the successor)
    resume   the hand-over failed after the freeze: all of it undone, in reverse order (the disk tier reopened,
             waiting for the successor to let go of its lock), and the daemon serves as before
    commit   the successor serves: leave the etcd lease and record to it, exit at once (os._exit: nothing that
             was handed over is closed or unlinked: the socket paths are the successor's now); with
             handover_linger, stay alive holding nothing until SIGTERM instead (a supervisor that restarts an
             exited process, Kubernetes, would otherwise start a second successor)
    decline  the successor starts cold: stop as on SIGTERM (main thread), its process exit tells the successor
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc

from kvstore._version import __version__
from kvstore.errors import ConfigError
from kvstore.server.handover.codec import encode_live, encode_origins, encode_sessions
from kvstore.server.handover.fdstore import JOURNAL_NAME, arena_name
from kvstore.server.handover.sender import Frozen
from kvstore.server.listeners import unlink_quietly
from kvstore.server.restart_log import log_adoption

if TYPE_CHECKING:
    from kvstore.arena.backing import ArenaBacking
    from kvstore.engine.engine import Engine
    from kvstore.engine.key_mirror import KeyIndexMirror
    from kvstore.engine.sessions import SessionBook
    from kvstore.peer import PeerCluster
    from kvstore.server.config import ServerConfig
    from kvstore.server.fast_server import FastServer
    from kvstore.server.gate import GateInterceptor
    from kvstore.server.background import Background
    from kvstore.server.handover.fdstore import Notifier
    from kvstore.server.handover.inherit import Inherited
    from kvstore.server.handover.sender import HandoverListener
    from kvstore.server.info import NodeInfo
    from kvstore.server.kv_events.publisher import KvEventsPublisher
    from kvstore.server.metrics import MetricsServer
    from kvstore.tiers.disk import DiskStore

__all__ = ["HandoverHostMixin"]

log = logging.getLogger("kvstore.server")
DRAIN_S = 5.0  # the longest the freeze waits for requests in flight (a get waiting on disk reads: promote_timeout)
COMMIT_GRACE_S = 0.5  # after the successor serves, how long gRPC calls still on this process's connections get


class HandoverHostMixin:
    cfg: ServerConfig
    arena: ArenaBacking
    engine: Engine
    key_index: KeyIndexMirror | None
    fast: FastServer | None
    gate: GateInterceptor
    disk: DiskStore | None
    peers: PeerCluster | None
    server: grpc.Server
    info: NodeInfo
    sessions: SessionBook
    lingering: bool
    metrics: MetricsServer | None
    kv_events: KvEventsPublisher | None
    taking_over: bool
    background: Background
    inherited: Inherited | None
    handover: HandoverListener | None
    notifier: Notifier
    _grpc_tmp: str

    def request_stop(self) -> None: ...  # noqa: E704

    def offer(self) -> tuple[dict[str, Any], list[int]]:
        lay = self.arena.layout
        names: list[list[str]] = [["journal", ""]]
        fds = [self.arena.journal.fd]
        for domain, f in self.arena.files().items():
            names.append(["arena", domain])
            fds.append(f.fd)
        tables = self.key_index.tables() if self.key_index is not None else {}
        for domain, t in tables.items():
            names.append(["index", domain])
            fds.append(t.fd)
        body = {"version": __version__, "files": names, "incarnation": self.info.incarnation,
                "isolated": self.arena.isolated, "index_capacity": next(iter(tables.values())).capacity if tables
                else 0, "index_entries": self.cfg.key_index_entries,
                "layout": {"name": lay.name, "n_slabs": lay.n_slabs, "slab_bytes": lay.slab_bytes,
                           "page_bytes": lay.page_bytes}}
        return body, fds

    def prepare(self) -> dict[str, Any]:
        t0 = time.monotonic()
        written = self.engine.sync_journal(self.arena.view, hash_missing=True, everything=True)
        log.info("hand-over: %d journal records written (%d blocks hashed so far) in %.3fs", written,
                 self.engine.journal.hashed if self.engine.journal else 0, time.monotonic() - t0)
        return {"records": written}

    def freeze(self) -> Frozen:
        t0 = time.monotonic()
        self.gate.close()
        open_conns = self.fast.pause(DRAIN_S) if self.fast is not None else 0
        calls = self.gate.drain(DRAIN_S)
        self.background.stop()
        left = self.engine.stop_for_handover()
        self.engine.freeze()
        self.engine.freeze_journal(self.arena.view)
        live = self.engine.export_live()
        if self.disk is not None:
            self.disk.close()
        body, blobs = encode_live(live)
        origins: list[list[Any]] = []
        if self.kv_events is not None:  # the successor names the blocks as this daemon's events did
            origins, blobs["origin_tokens"] = encode_origins(self.kv_events.export_origins())
        entries = self.sessions.entries()
        out = {"live": body, "sessions": encode_sessions(entries, [self.sessions.age_s(e) for e in entries]),
               "peer_lease": self.peers.membership.lease if self.peers is not None and self.peers.membership else 0,
               "kv_origins": origins}
        log.info("hand-over: frozen in %.3fs (%d fast-path connections and %d gRPC calls still open, %d queued "
                 "disk writes left to the successor)", time.monotonic() - t0, open_conns, calls, left)
        fds = [self.fast.listener.fileno()] if self.fast is not None and self.fast.listener is not None else []
        return out, blobs, fds

    def resume(self, why: str) -> None:
        if self.disk is not None:
            self._reopen_disk()
        self.engine.thaw()
        self.engine.end_handover_hashing()
        self.engine.restart_io()
        self.background.start()
        self.gate.reopen()
        if self.fast is not None:
            self.fast.resume()
        log.warning("hand-over failed (%s): serving again", why)

    def _reopen_disk(self) -> None:
        """The successor may still hold the disk tier's lock for a moment after its ABORT: retry for a while."""
        assert self.disk is not None
        deadline = time.monotonic() + 10.0
        while True:
            try:
                self.disk.open()
                return
            except ConfigError as exc:
                if time.monotonic() > deadline:
                    log.error("the disk tier could not be reopened after the failed hand-over (%s): serving RAM "
                              "only; restart the daemon", exc)
                    return
                time.sleep(0.05)

    def commit(self) -> None:
        if self.peers is not None:
            self.peers.stop(revoke=False)  # no leave, no hand-off: the successor keeps the lease and the blocks
        # GOAWAY on every gRPC connection: clients open new ones, to the successor (the path is its now; ours,
        # bound under another name, is what grpc unlinks); calls meanwhile meet the closed gate and retry
        self.server.stop(COMMIT_GRACE_S).wait(COMMIT_GRACE_S + 1)
        if self.metrics is not None:  # its port is the successor's next
            self.metrics.stop()
        if self.kv_events is not None:  # so are its event endpoints (the successor sends what it holds)
            self.kv_events.stop()
            self.kv_events = None
        if self.cfg.handover_linger:  # a supervisor would restart an exited process: stay, holding nothing
            self.lingering = True
            self.arena.destroy(unmap=True)
            log.info("handed over: holding nothing, waiting for SIGTERM (handover_linger)")
            return
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def decline(self, why: str) -> None:
        threading.Thread(target=self.request_stop, name="kvstore-decline", daemon=True).start()

    # -- the successor's side, and the ways a restart starts -----------------------------------------------
    def start_late(self, predecessor_gone: bool = True) -> None:
        """What needs the old process gone first: the metrics port, the KV event endpoints, the peer tier (its data-plane port; the etcd
        lease it handed over), this daemon's own hand-over socket."""
        if self.metrics is not None:
            if self.taking_over and not self.metrics.bind_when_free(5.0 if predecessor_gone else 0.5):
                self.metrics = None
            if self.metrics is not None:
                self.metrics.start()
        if self.kv_events is not None and self.taking_over:
            if self.kv_events.bind_when_free(5.0 if predecessor_gone else 0.5):
                self.kv_events.start()
            else:
                self.kv_events = None
        if self.peers is not None:
            lease = self.inherited.peer_lease if self.taking_over and self.inherited else 0
            self.peers.start(lease=lease)
        if self.handover is not None:
            try:
                self.handover.start()
            except (ConfigError, OSError) as exc:
                log.warning("no hand-over socket (%s): a successor cannot take over from this daemon", exc)
                self.handover = None

    def _adopt(self, inh: Inherited, adoption: tuple, tables_kept: bool, seconds: float) -> None:
        """Place what the predecessor held in the fresh engine (verified by handover/inherit.py), count and log it."""
        entries, verification, _, bad_namespaces = adoption
        slab_domain = [self.arena.domain_of_slab(s) for s in range(self.arena.layout.n_slabs)]
        report, _ = self.engine.adopt(entries, inh.live, self.engine.lost_namespaces, slab_domain, tables_kept)
        self.adopted_blocks = report.blocks
        dropped = dict(verification.dropped)
        for reason, n in report.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
        self.engine.count_restart(report.blocks, dropped)
        restored = self.sessions.restore(inh.sessions) if inh.sessions else 0
        log_adoption(inh.source, report, verification, bad_namespaces, self.engine.lost_namespaces, restored,
                     seconds, kept_incarnation=bool(tables_kept or (inh.incarnation and
                                                                     self.info.incarnation == inh.incarnation)))

    def _store_files(self) -> None:
        """Under systemd's fd store: every memory file and the journal (and each tenant's file as it comes)."""
        n = self.notifier
        if not n.store_enabled:
            return
        n.store(JOURNAL_NAME, self.arena.journal.fd)
        for domain, f in self.arena.files().items():
            n.store(arena_name(self.arena.domain_index(domain)), f.fd)
        self.arena.on_new_file.append(lambda domain, f: n.store(arena_name(self.arena.domain_index(domain)), f.fd))

    def abandon(self) -> None:
        """A successor whose take-over was aborted (the old daemon serves on): let go of the disk tier and the
        temporary socket, touch nothing the old daemon uses, and exit."""
        if self.disk is not None:
            self.disk.close()
        if self._grpc_tmp:
            unlink_quietly(self._grpc_tmp)
        if self.metrics is not None:
            self.metrics.stop()

    def spawn_successor(self) -> None:
        """SIGUSR2: start `kvstore-server <the same arguments> --take-over` beside this one; it takes over and
        this process exits (handover/sender.py). Under systemd the successor reports MAINPID itself."""
        args = [a for a in sys.argv[1:] if a != "--take-over"]
        cmd = [sys.executable, "-m", "kvstore.server.main", *args, "--take-over"]
        log.info("SIGUSR2: starting a successor to take over: %s", " ".join(cmd))
        try:
            subprocess.Popen(cmd, close_fds=True)
        except OSError as exc:
            log.error("cannot start a successor (%s): serving on", exc)
