"""`kvstore-server`: the composition root. Builds every concrete part from one ServerConfig and runs them.

The config hands over each component's own config (cfg.engine_config(), disk_config(), peer_config()),
already validated; this module only wires the parts together.

Start-up order: config (fails before anything exists) -> arena (pre-faulted, locked) -> allocator, policy,
disk tier (recovered or wiped) -> engine -> disk I/O threads, gRPC server on the unix socket and TCP ->
sweeper thread -> peer tier (only with etcd_endpoints: data-plane listener, etcd registration and watch, pusher,
hand-off). Shutdown on SIGTERM/SIGINT runs the other way: hand this node's blocks to their next owners while
still a member (peer_leave_timeout_s), leave the cluster, stop accepting RPCs, let in-flight ones finish
(grace), stop the sweeper, finish queued disk writes, close the disk tier, remove the arena and socket.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from concurrent import futures
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.arena import vm
from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.backing import ArenaBacking
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.key_mirror import KeyIndexMirror
from kvstore.errors import ConfigError
from kvstore.peer import PeerCluster
from kvstore.policies import make_policy
from kvstore.policies.admission import make_admission
from kvstore.server.config import ServerConfig, load_config
from kvstore.server.config.security import unused_peer_settings
from kvstore.server.info import NodeInfo
from kvstore.server.logs import setup_logging
from kvstore.server.metric_labels import MetricLabels
from kvstore.server.metrics import MetricsServer
from kvstore.server.auth import AuthInterceptor
from kvstore.fastpath.sockets import clear_stale_socket
from kvstore.server.fast_server import FastServer, fast_socket_path
from kvstore.server.routing_ops import RoutingOps
from kvstore.server.service import KVStoreService
from kvstore.server.tenancy import TenantGuard
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.sessions import SessionBook
from kvstore.security import TokenTable, check_not_world_writable_dir, is_loopback_address
from kvstore.server.tenant_usage import TenantUsage
from kvstore.server.token_reload import TokenWatcher
from kvstore.tiers.disk import BlockIO, DiskConfig, DiskStore, TenantFloors
from kvstore.transfers import TransferMeter

if TYPE_CHECKING:
    from kvstore.server.kv_events.publisher import KvEventsPublisher

__all__ = ["main", "Daemon"]

log = logging.getLogger("kvstore.server")
SHUTDOWN_GRACE_S = 5.0


class Daemon:
    """Everything one running kvstore-server owns, built from its config."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        _check_state_dirs(cfg)  # before the arena exists: refuse world-writable socket / disk directories
        self.tokens = TokenTable.load(cfg.tokens_file) if cfg.tokens_file else None
        self.token_watcher: TokenWatcher | None = None  # set with the auth interceptor (_build_server)
        self.auth: AuthInterceptor | None = None        # the interceptor; its table is replaced on reload
        layout = ArenaLayout.for_capacity(cfg.shm_name.lstrip("/"), cfg.arena_bytes, cfg.max_block_bytes)
        # With tokens every tenant's blocks live in a memory file of its own (arena/backing.py), and this
        # process must not let another process of the same user open those files through /proc/<pid>/fd.
        isolated = self.tokens is not None
        if isolated:
            vm.set_dumpable(False)
        self.arena = ArenaBacking(layout, isolated=isolated, lock=cfg.arena_lock)
        self.transfers = TransferMeter()  # data-plane bytes and timings: disk I/O and the service feed it
        self.key_index: KeyIndexMirror | None = None  # the shared key index (_build_fast): same-node clients only
        try:
            self.engine_config = cfg.engine_config()
            allocator = SlabAllocator(layout.data_offset, layout.data_bytes, cfg.max_block_bytes,
                                      bind=self.arena.bind if isolated else None)
            disk_config = cfg.disk_config()  # None with disk_bytes = 0
            self.disk = self._open_disk(disk_config) if disk_config is not None else None
            self.engine = Engine(self.engine_config, layout, self.arena.generations, allocator,
                                 make_policy(cfg.policy), disk=self.disk,
                                 admission=make_admission(cfg.disk_admission), arena_address=self.arena.address,
                                 quotas=TenantQuotas(cfg.ram_quotas))
            owners = cfg.disk_dir.rstrip("/") + ".owners.json" if self.disk is not None else ""
            self.guard = TenantGuard(self.engine, owners)
            self.engine.assign_recovered_tenants(self.guard.known_owners())
            disk_quotas = TenantQuotas(cfg.disk_quotas)
            if self.disk is not None and disk_quotas.enabled:
                self.disk.set_floors(TenantFloors(tenant_of=self.guard.owner_of, quota_of=disk_quotas.quota))
            self.tenants = TenantUsage(self.guard.owner_of, TenantQuotas(cfg.ram_quotas), disk_quotas)
            self.info = NodeInfo(cfg.node_id, self.arena, self.engine_config, self.engine.disk_degraded_reason)
            self.peers = self._build_peers() if cfg.peer_endpoints else None
            if self.peers is not None:
                self.info.peer_status = self.peers.status
            self.kv_events = self._build_kv_events() if cfg.kv_events else None
            self.info.kv_events = self.kv_events is not None
            self.metrics = (MetricsServer(cfg.metrics_listen, self.engine, self.arena.locked, self._healthz,
                                          self.transfers, self.info.peer_status, self.tenants,
                                          labels=MetricLabels.load(cfg.metrics_labels, cfg.metrics_label_key_file),
                                          control=self._control_status,
                                          kv_events=self.kv_events.status if self.kv_events is not None else None)
                            if cfg.metrics_listen else None)
            self.server = self._build_server()
            self.fast = self._build_fast()
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
            raise
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="kvstore-sweeper", daemon=True)

    def _open_disk(self, config: DiskConfig) -> DiskStore:
        """The disk tier, recovered or wiped, before any RPC is served (the store locks its directory)."""
        store = DiskStore(config, io=BlockIO(transfers=self.transfers))
        store.open(wipe=self.cfg.disk_wipe)  # logs what it recovered
        return store

    def _build_peers(self) -> PeerCluster:
        """The peer tier (etcd membership + data plane); started after the gRPC server, stopped before it."""
        cfg = self.cfg
        capacity = self.arena.layout.data_bytes + (cfg.disk_bytes if self.disk is not None else 0)
        return PeerCluster(cfg.peer_config(capacity), self.engine, self.arena.view, self.transfers)

    def _build_kv_events(self) -> KvEventsPublisher:
        """The vLLM-format event publisher (kv_events): subscribed to the engine's events now, so nothing stored
        before start() is missed; binds its sockets now, so a taken address stops the daemon here."""
        try:
            from kvstore.server.kv_events.publisher import KvEventsPublisher
        except ImportError as exc:
            raise ConfigError(f"kv_events = true needs pyzmq and msgpack ({exc}): pip install 'kvstore[events]'") from exc
        engine = self.engine

        def snapshot() -> Iterator[tuple[str, list[bytes], list[bytes]]]:
            for ns in engine.stats().namespaces:
                yield (ns.name, *engine.tier_keys(ns.name))
        return KvEventsPublisher(self.cfg.kv_events_config(), engine.events, engine.namespace_labels, snapshot,
                                 origin_capacity=max(1 << 16, 16 * self.cfg.max_batch_keys))

    def _build_server(self) -> grpc.Server:
        cfg = self.cfg
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        interceptors: list[grpc.ServerInterceptor] = []
        if self.tokens is not None:
            auth = AuthInterceptor(self.tokens)
            self.auth = auth
            self.token_watcher = TokenWatcher(cfg.tokens_file, auth)
            interceptors.append(auth)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers,
                                                        thread_name_prefix="kvstore-rpc"), options=opts,
                             interceptors=interceptors)
        observe = self.metrics.observe if self.metrics is not None else (lambda method, seconds: None)
        routing = RoutingOps(self.engine, self.guard, cfg.node_id, cfg.peer_control_advertise or cfg.listen,
                             publisher=self.kv_events, peers=self.peers)
        service = KVStoreService(self.engine, self.arena.view, self.info, observe, cfg.max_subscribers,
                                 transfers=self.transfers, guard=self.guard, tenants=self.tenants,
                                 sessions=SessionBook(cfg.session_book_max, cfg.session_book_keys), routing=routing)
        self.ops = service.ops  # the hot operations, shared with the same-node fast path
        pb_grpc.add_KVStoreServicer_to_server(service, server)
        if cfg.unix_socket:
            _prepare_socket_dir(cfg.unix_socket)
            server.add_insecure_port("unix:" + cfg.unix_socket)
        if cfg.listen:
            try:
                if cfg.tls.enabled:  # mutual TLS when tls_ca is set (config/security.py checked the files)
                    server.add_secure_port(cfg.listen, cfg.tls.grpc_server_credentials())
                else:
                    server.add_insecure_port(cfg.listen)
            except RuntimeError as exc:
                raise ConfigError(f"cannot listen on {cfg.listen}: address in use or not local ({exc})") from exc
        return server

    def _build_fast(self) -> FastServer | None:
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
                                                       authoritative=self.disk is None and self.peers is None)
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

    def _warn_exposure(self) -> None:
        cfg = self.cfg
        exposed = [a for a in (cfg.listen, cfg.peer_listen if cfg.peer_endpoints else "") if a
                   and not is_loopback_address(a)]
        if exposed and not cfg.tls.enabled:
            log.warning("SECURITY: allow_insecure_remote is set and %s %s reachable from other hosts WITHOUT TLS: "
                        "anyone on the network can read and write every block%s", ", ".join(exposed),
                        "is" if len(exposed) == 1 else "are",
                        "" if self.tokens else " (and there are no tokens)")
        unused = unused_peer_settings(cfg)
        if unused:
            log.info("peer tier off (etcd_endpoints is empty): %s not used; set etcd_endpoints to join a cluster",
                     ", ".join(unused))
        if cfg.kv_events and any(a.startswith("tcp://") and not is_loopback_address(a[len("tcp://"):])
                                 for a in (cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint)):
            log.warning("SECURITY: allow_insecure_remote is set and the KV event stream (%s) is reachable from other "
                        "hosts without authentication: anyone on the network can read which blocks and tokens this "
                        "node holds", cfg.kv_events_endpoint)
        if cfg.metrics_listen and not is_loopback_address(cfg.metrics_listen):
            shown = "up to 50 namespace names" if cfg.metrics_labels == "name" else f"{cfg.metrics_labels} labels, no names"
            log.warning("metrics_listen=%s is reachable from other hosts over plain HTTP (counters and %s; no keys or "
                        "bytes)", cfg.metrics_listen, shown)

    def start(self) -> None:
        self._warn_exposure()
        self.engine.start()
        if self.kv_events is not None:  # before any RPC: the first put's events go out
            self.kv_events.start()
        if self.metrics is not None:
            self.metrics.start()
        if self.fast is not None:  # before gRPC: a client that sees Health can get its arena at once
            self.fast.start()
        self.server.start()
        if self.cfg.unix_socket:
            os.chmod(self.cfg.unix_socket, 0o600)
        self._sweeper.start()
        if self.peers is not None:
            self.peers.start()
        lay = self.arena.layout
        log.info("serving node=%s unix=%s tcp=%s%s tokens=%s arena=%s bytes=%d locked=%s policy=%s disk=%s pid=%d",
                 self.cfg.node_id, self.cfg.unix_socket or "-", self.cfg.listen or "-",
                 ("+mtls" if self.cfg.tls_ca else "+tls") if self.cfg.tls.enabled else "",
                 len(self.tokens.tenants) if self.tokens else "off",
                 f"{lay.name} (one file per tenant)" if self.arena.isolated else lay.name,
                 lay.data_bytes, self.arena.locked, self.cfg.policy,
                 f"{self.cfg.disk_dir}:{self.cfg.disk_bytes}" if self.disk else "off", os.getpid())

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.cfg.sweep_interval_s):
            try:
                self.engine.sweep()
                if self.token_watcher is not None:
                    self.token_watcher.poll()
            except Exception:  # the sweeper must outlive a bug in one pass; the log says what happened
                log.exception("sweep failed")

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
        self._stop.set()
        if self.peers is not None:
            self.peers.leave()  # hand blocks over, then leave the cluster: peers stop routing here at once
        if self.fast is not None:
            self.fast.stop()
        self.server.stop(SHUTDOWN_GRACE_S).wait()
        if self._sweeper.is_alive():
            self._sweeper.join(timeout=2)
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


def _check_state_dirs(cfg: ServerConfig) -> None:
    """The socket's directory and the disk tier's directory must not be writable by other users, nor belong to
    one. (A world-writable parent such as a tmpfs mount point is fine: the sticky bit keeps our directory ours,
    and an existing one owned by someone else is refused.)"""
    if cfg.unix_socket:
        check_not_world_writable_dir(os.path.dirname(cfg.unix_socket) or ".", "unix_socket directory")
    if cfg.disk_bytes:
        check_not_world_writable_dir(cfg.disk_dir, "disk_dir")


def _prepare_socket_dir(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    clear_stale_socket(path, "unix socket")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as exc:
        print(f"kvstore-server: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level, cfg.log_format, cfg.node_id)
    os.umask(0o077)  # everything the daemon creates (socket, disk files, owners file) is owner-only
    try:
        daemon = Daemon(cfg)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: daemon.reload_tokens())
    daemon.start()
    daemon.wait()
    daemon.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
