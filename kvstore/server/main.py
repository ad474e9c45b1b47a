"""`kvstore-server`: the composition root. Builds every concrete part from one ServerConfig and runs them.

The config hands over each component's own config (cfg.engine_config(), disk_config(), peer_config()),
already validated; this module only wires the parts together.

Start-up order: config (fails before anything exists) -> arena (pre-faulted, locked; or a predecessor's, see
below) -> allocator, policy, disk tier (recovered or wiped) -> engine (+ the RAM journal) -> disk I/O threads,
gRPC server on the unix socket and TCP -> sweeper and journal threads -> peer tier (only with etcd_endpoints:
data-plane listener, etcd registration and watch, pusher, hand-off) -> the hand-over socket. Shutdown on
SIGTERM/SIGINT runs the other way: hand this node's blocks to their next owners while still a member
(peer_leave_timeout_s), leave the cluster, stop accepting RPCs, let in-flight ones finish (grace), stop the
sweeper, finish queued disk writes, close the disk tier, remove the arena and socket.

Restarts that keep the RAM tier (docs/operations.md; kvstore/server/handover/ has the protocol):
- `--take-over` (or SIGUSR2 to the running daemon, which starts its successor itself): the successor gets the
  running daemon's files, verifies them, and takes over its sockets (the same-node socket's listener itself;
  gRPC's unix path by an atomic rename of its own, TCP by SO_REUSEPORT); the old one exits (handover_host.py).
- systemd's fd store (fdstore): the files of a daemon that stopped or crashed come back at start.
Either way the arena is adopted, not copied, and every block served is verified first (handover/inherit.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.arena import vm
from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.backing import ArenaBacking
from kvstore.engine.engine import Engine
from kvstore.engine.key_mirror import KeyIndexMirror
from kvstore.errors import ConfigError
from kvstore.fastpath.key_index import IndexTable
from kvstore.server import heap
from kvstore.server.gate import GateInterceptor
from kvstore.server.handover.fdstore import Notifier
from kvstore.server.handover.holds import stage_hook
from kvstore.server.handover.inherit import Inherited, carried_index, verified_entries
from kvstore.server.handover.start import arena_layout, inherit
from kvstore.server.background import Background
from kvstore.server.listeners import (check_port_free, check_state_dirs, prepare_socket_dir, unlink_quietly,
                                      warn_exposure)
from kvstore.server.handover.protocol import handover_socket_path
from kvstore.server.handover.receiver import TakeOver, TakeOverFailed
from kvstore.server.handover.sender import HandoverListener
from kvstore.server.handover_host import HandoverHostMixin
from kvstore.policies import make_policy
from kvstore.policies.admission import make_admission
from kvstore.server.config import ServerConfig, load_config
from kvstore.server.info import NodeInfo
from kvstore.server.logs import setup_logging
from kvstore.server.metric_labels import MetricLabels
from kvstore.server.metrics import MetricsServer
from kvstore.server.parts import kv_events_publisher, open_disk, peer_cluster, write_budget
from kvstore.server.auth import AuthInterceptor
from kvstore.server.fast_server import FastServer, fast_socket_path
from kvstore.server.routing_ops import RoutingOps
from kvstore.server.service import KVStoreService
from kvstore.server.tenancy import TenantGuard
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.sessions import SessionBook
from kvstore.security import TokenTable
from kvstore.server.tenant_usage import TenantUsage
from kvstore.server.token_reload import TokenWatcher
from kvstore.tiers.disk import DiskStore, TenantFloors
from kvstore.transfers import TransferMeter

if TYPE_CHECKING:
    from kvstore.server.kv_events.publisher import KvEventsPublisher

__all__ = ["main", "Daemon"]

log = logging.getLogger("kvstore.server")
SHUTDOWN_GRACE_S = 5.0
JOURNAL_SYNC_S = 1.0  # how far the RAM journal may lag the catalog (a crash under the fd store loses that much)


class Daemon(HandoverHostMixin):
    """Everything one running kvstore-server owns, built from its config (and, for a restart that keeps the RAM
    tier, from what a predecessor handed over: `inherited`)."""

    def __init__(self, cfg: ServerConfig, inherited: Inherited | None = None, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        check_state_dirs(cfg)  # before the arena exists: refuse world-writable socket / disk directories
        self.tokens = TokenTable.load(cfg.tokens_file) if cfg.tokens_file else None
        self.token_watcher: TokenWatcher | None = None  # set with the auth interceptor (_build_server)
        self.auth: AuthInterceptor | None = None        # the interceptor; its table is replaced on reload
        self.notifier = notifier or Notifier("off")
        layout = arena_layout(cfg)
        # With tokens every tenant's blocks live in a memory file of its own (arena/backing.py), and this
        # process must not let another process of the same user open those files through /proc/<pid>/fd.
        isolated = self.tokens is not None
        if isolated:
            vm.set_dumpable(False)
        inh = inherited if inherited is not None and inherited.arena is not None else None
        self.inherited = inh
        self.taking_over = inh is not None and inh.fast_listener is not None  # a live hand-over, not a crash
        self.arena = (inh.arena if inh is not None and inh.arena is not None
                      else ArenaBacking(layout, isolated=isolated, lock=cfg.arena_lock))
        self.transfers = TransferMeter()  # data-plane bytes and timings: disk I/O and the service feed it
        self.key_index: KeyIndexMirror | None = None  # the shared key index (_build_fast): same-node clients only
        self.gate = GateInterceptor()  # closed by a hand-over's freeze (gate.py)
        self._grpc_tmp = ""  # the gRPC unix socket under its own name, until start() renames it over unix_socket
        self.adopted_blocks = 0
        try:
            t0 = time.monotonic()
            adoption = verified_entries(self.arena, inh.known) if inh is not None else None
            self.engine_config = cfg.engine_config()
            allocator = SlabAllocator(layout.data_offset, layout.data_bytes, cfg.max_block_bytes,
                                      bind=self.arena.bind if isolated else None)
            disk_config = cfg.disk_config()  # None with disk_bytes = 0
            self.disk = open_disk(disk_config, self.transfers, cfg.disk_wipe) if disk_config is not None else None
            self.engine = Engine(self.engine_config, layout, self.arena.generations, allocator,
                                 make_policy(cfg.policy), disk=self.disk,
                                 admission=make_admission(cfg.disk_admission), arena_address=self.arena.address,
                                 quotas=TenantQuotas(cfg.ram_quotas), write_mode=cfg.disk_write,
                                 budget=write_budget(cfg),
                                 namespaces=adoption[2] if adoption is not None else None)
            self.engine.attach_journal(self.arena.journal, self.arena.generations)
            owners = cfg.disk_dir.rstrip("/") + ".owners.json" if self.disk is not None else ""
            self.guard = TenantGuard(self.engine, owners)
            self.engine.assign_recovered_tenants(self.guard.known_owners())
            disk_quotas = TenantQuotas(cfg.disk_quotas)
            if self.disk is not None and disk_quotas.enabled:
                self.disk.set_floors(TenantFloors(tenant_of=self.guard.owner_of, quota_of=disk_quotas.quota))
            self.tenants = TenantUsage(self.guard.owner_of, TenantQuotas(cfg.ram_quotas), disk_quotas)
            tables, incarnation = carried_index(inh, cfg.key_index_entries,
                                                adoption[1].dropped.get("header", 0) if adoption else 0)
            self.info = NodeInfo(cfg.node_id, self.arena, self.engine_config, self.engine.disk_degraded_reason,
                                 incarnation=incarnation)
            self.peers = (peer_cluster(cfg, self.arena, self.engine, self.disk is not None, self.transfers)
                          if cfg.peer_endpoints else None)
            if self.peers is not None:
                self.info.peer_status = self.peers.status
            self.kv_events = (kv_events_publisher(cfg, self.engine, bind=not self.taking_over)
                              if cfg.kv_events else None)
            if self.kv_events is not None and inh is not None and inh.kv_origins:
                self.kv_events.restore_origins(inh.kv_origins)
            self.info.kv_events = self.kv_events is not None
            self.metrics = (MetricsServer(cfg.metrics_listen, self.engine, self.arena.locked, self._healthz,
                                          self.transfers, self.info.peer_status, self.tenants,
                                          labels=MetricLabels.load(cfg.metrics_labels, cfg.metrics_label_key_file),
                                          control=self._control_status, bind=not self.taking_over,
                                          kv_events=self.kv_events.status if self.kv_events is not None else None)
                            if cfg.metrics_listen else None)
            self.sessions = SessionBook(cfg.session_book_max, cfg.session_book_keys)
            self.server = self._build_server()
            self.fast = self._build_fast(tables)
            if inh is not None and adoption is not None:
                self._adopt(inh, adoption, tables is not None, time.monotonic() - t0)
        except BaseException:  # undo what was built so far, in reverse order
            metrics: MetricsServer | None = getattr(self, "metrics", None)
            if metrics is not None:
                metrics.stop()
            publisher: KvEventsPublisher | None = getattr(self, "kv_events", None)
            if publisher is not None:
                publisher.stop()
            self.arena.destroy(unmap=True)
            disk: DiskStore | None = getattr(self, "disk", None)
            if disk is not None:
                disk.close()
            if self._grpc_tmp:
                unlink_quietly(self._grpc_tmp)
            raise
        self._stop = threading.Event()
        self.handover: HandoverListener | None = (
            HandoverListener(handover_socket_path(cfg.unix_socket), self, cfg.tokens_file, cfg.handover_timeout_s,
                             stage=stage_hook("sender")) if cfg.unix_socket else None)
        self.background = Background(self.engine, self.arena, self.cfg.sweep_interval_s, JOURNAL_SYNC_S,
                                     hash_missing=self.notifier.store_enabled, token_watcher=self.token_watcher)
        self.lingering = False  # handed over with handover_linger: waits for SIGTERM, then exits (main)

    def _build_server(self) -> grpc.Server:
        cfg = self.cfg
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 1)]  # a successor binds the port while this daemon still holds it
        interceptors: list[grpc.ServerInterceptor] = []
        if self.tokens is not None:
            auth = AuthInterceptor(self.tokens)
            self.auth = auth
            self.token_watcher = TokenWatcher(cfg.tokens_file, auth)
            interceptors.append(auth)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers,
                                                        thread_name_prefix="kvstore-rpc"), options=opts,
                             interceptors=[self.gate, *interceptors])
        observe = self.metrics.observe if self.metrics is not None else (lambda method, seconds: None)
        routing = RoutingOps(self.engine, self.guard, cfg.node_id, cfg.peer_control_advertise or cfg.listen,
                             publisher=self.kv_events, peers=self.peers)
        service = KVStoreService(self.engine, self.arena.view, self.info, observe, cfg.max_subscribers,
                                 transfers=self.transfers, guard=self.guard, tenants=self.tenants,
                                 sessions=self.sessions, routing=routing)
        self.ops = service.ops  # the hot operations, shared with the same-node fast path
        pb_grpc.add_KVStoreServicer_to_server(service, server)
        if cfg.unix_socket and not self.taking_over:
            prepare_socket_dir(cfg.unix_socket)  # refuses a socket a running daemon answers on
        if cfg.listen and not self.taking_over:  # SO_REUSEPORT (for a successor) must not hide a second daemon
            check_port_free(cfg.listen)
        return server

    def _add_ports(self) -> None:
        """Bind gRPC's listeners now, right before the server starts: bound earlier, a socket accepts connections
        that wait unanswered while the daemon recovers its disk tier or adopts its arena, and a client that
        dialled then waits out its timeout instead of finding the daemon not there yet.

        The unix socket is bound at a path of this process's own and renamed over unix_socket by start(): gRPC
        unlinks the path it bound when it stops, and after a hand-over unix_socket is the successor's."""
        cfg, server = self.cfg, self.server
        if cfg.unix_socket:
            if not self.taking_over:
                prepare_socket_dir(cfg.unix_socket)
            self._grpc_tmp = f"{cfg.unix_socket}.{os.getpid()}.new"
            unlink_quietly(self._grpc_tmp)
            server.add_insecure_port("unix:" + self._grpc_tmp)
        if cfg.listen:
            try:
                if cfg.tls.enabled:  # mutual TLS when tls_ca is set (config/security.py checked the files)
                    server.add_secure_port(cfg.listen, cfg.tls.grpc_server_credentials())
                else:
                    server.add_insecure_port(cfg.listen)
            except RuntimeError as exc:
                raise ConfigError(f"cannot listen on {cfg.listen}: address in use or not local ({exc})") from exc

    def _build_fast(self, tables: dict[str, IndexTable] | None = None) -> FastServer | None:
        """The same-node socket: hands local clients their arena file and answers the fast path (none without a
        unix socket: clients then stream over gRPC). With tokens, the token decides which tenant's file and which
        tenant's requests; the reload updates the table in place, and a revoked token is refused at once."""
        path = fast_socket_path(self.cfg.unix_socket)
        if not path:
            return None
        self.info.arena_socket = path
        auth = self.auth
        tenant_of = (lambda token: auth.tokens.tenant_of(token)) if auth is not None else None
        observe = self.metrics.observe if self.metrics is not None else (lambda method, seconds: None)
        # a key absent from RAM is absent only where RAM is the only tier: no disk tier, no peers
        self.key_index = (self.engine.attach_key_index(self.cfg.key_index_entries, self.info.incarnation,
                                                       per_tenant=self.tokens is not None,
                                                       authoritative=self.disk is None and self.peers is None,
                                                       adopted=tables)
                          if self.cfg.key_index_entries else None)
        fast = FastServer(path, self.arena, self.ops, self.info.incarnation, self.cfg.max_batch_keys, tenant_of,
                          observe, spin_us=self.cfg.fast_spin_us, key_index=self.key_index)
        self.info.fast_status = fast.status
        if self.token_watcher is not None:
            self.token_watcher.on_reload.append(fast.drop_revoked)
        return fast

    def _control_status(self) -> dict[str, int]:
        """The same-node socket's counters, its connections' spare slots and the shared key index's fill."""
        out = self.info.fast_status() if self.info.fast_status else {}
        if out:
            out = {**out, **self.engine.spare_status()}
        return {**out, **self.key_index.status()} if self.key_index is not None else out

    def _healthz(self) -> tuple[int, str]:
        """200 while serving (a degraded disk tier still serves from RAM), 503 while stopping."""
        h = self.info.health()
        return (200 if h.status in ("SERVING", "DEGRADED") else 503), h.status + (f": {h.detail}" if h.detail else "")

    def start(self) -> None:
        """Serve. A successor taking over (a live hand-over) serves on the listener it was handed and renames
        its gRPC socket over the path; `start_late` then takes what the old process still holds (metrics port,
        peer tier, hand-over socket) once it is gone."""
        warn_exposure(self.cfg, bool(self.tokens))
        self.engine.start()
        if self.kv_events is not None and not self.taking_over:  # before any RPC: the first put's events go out
            self.kv_events.start()
        if self.fast is not None:  # before gRPC: a client that sees Health can get its arena at once
            self.fast.start(listener=self.inherited.fast_listener if self.taking_over and self.inherited else None)
        self._add_ports()
        self.server.start()
        if self._grpc_tmp:
            os.rename(self._grpc_tmp, self.cfg.unix_socket)  # atomic: a dialler finds the old daemon or this one
            self._grpc_tmp = ""
        if self.cfg.unix_socket:
            os.chmod(self.cfg.unix_socket, 0o600)
        self.background.start()
        if not self.taking_over:
            self.start_late()
        self._store_files()
        heap.settle(self.cfg.gc_young_threshold)  # after every startup structure is built, before the first request
        self.notifier.notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving")
        lay = self.arena.layout
        log.info("serving node=%s unix=%s tcp=%s%s tokens=%s arena=%s bytes=%d locked=%s policy=%s disk=%s pid=%d",
                 self.cfg.node_id, self.cfg.unix_socket or "-", self.cfg.listen or "-",
                 ("+mtls" if self.cfg.tls_ca else "+tls") if self.cfg.tls.enabled else "",
                 len(self.tokens.tenants) if self.tokens else "off",
                 f"{lay.name} (one file per tenant)" if self.arena.isolated else lay.name,
                 lay.data_bytes, self.arena.locked, self.cfg.policy,
                 f"{self.cfg.disk_dir}:{self.cfg.disk_bytes}" if self.disk else "off", os.getpid())

    def reload_tokens(self) -> None:
        """SIGHUP: re-read tokens_file at the next sweep (token_reload.py); without tokens, nothing to do."""
        if self.token_watcher is not None:
            self.token_watcher.request()

    def request_stop(self) -> None:
        self._stop.set()

    def wait(self) -> None:
        self._stop.wait()

    def shutdown(self) -> None:
        log.info("shutting down: draining RPCs for up to %.1fs", SHUTDOWN_GRACE_S)
        self.info.status = "STOPPING"
        self.notifier.notify("STOPPING=1")
        self._stop.set()
        if self.handover is not None:
            self.handover.stop()
        if self.peers is not None:
            self.peers.leave()  # hand blocks over, then leave the cluster: peers stop routing here at once
        if self.fast is not None:
            self.fast.stop()
        self.server.stop(SHUTDOWN_GRACE_S).wait()
        self.background.stop()
        if self.notifier.store_enabled:  # systemd keeps the files: a restart serves every block it can check
            self.engine.sync_journal(self.arena.view, hash_missing=True)
        self.engine.stop()
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.key_index is not None:
            self.key_index.close()
        if self.metrics is not None:
            self.metrics.stop()
        if self.disk is not None:
            self.disk.close()
        self.arena.destroy()
        if self.cfg.unix_socket:
            try:
                os.unlink(self.cfg.unix_socket)
            except FileNotFoundError:
                pass
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
        notifier = Notifier(cfg.fdstore)
    except ConfigError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format, cfg.node_id)
    os.umask(0o077)  # everything the daemon creates (socket, disk files, owners file) is owner-only
    try:
        takeover, inherited = inherit(cfg, notifier)
    except TakeOverFailed as exc:
        log.error("take-over failed: %s", exc)
        return 1
    try:
        daemon = Daemon(cfg, inherited, notifier)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    try:
        return _run(daemon, takeover, cfg)
    except ConfigError as exc:  # a listener that could not be bound at start
        log.error("%s", exc)
        daemon.shutdown()
        return 2


def _run(daemon: Daemon, takeover: TakeOver | None, cfg: ServerConfig) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: daemon.reload_tokens())
    signal.signal(signal.SIGUSR2, lambda *_: daemon.spawn_successor())
    if takeover is not None and daemon.taking_over:
        try:
            takeover.ready(daemon.adopted_blocks)
        except TakeOverFailed as exc:
            log.error("take-over failed: %s", exc)
            daemon.abandon()
            return 1
        daemon.start()
        takeover.serving()
        daemon.start_late(takeover.predecessor_gone(max(10.0, cfg.peer_leave_timeout_s)))
    else:
        daemon.start()
    daemon.wait()
    if daemon.lingering:  # handed over: everything it held is the successor's
        log.info("SIGTERM after the hand-over: exiting")
        logging.shutdown()
        os._exit(0)
    daemon.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
