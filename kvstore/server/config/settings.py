"""ServerConfig: every setting of the daemon, one flat list of keys grouped in sections, and the parts it builds.

The keys stay flat (a TOML key, a KVSTORE_* variable and a --flag each: loader.py); each field's metadata
names its section (SECTIONS) and its help, which `kvstore-server --help` and docs/configuration.md (doc.py)
both print. ServerConfig builds the components' own configs, which check their own rules at construction:

    engine_config()  -> EngineConfig  (kvstore/engine/config.py)
    disk_config()    -> DiskConfig    (kvstore/tiers/disk/config.py), None with disk_bytes = 0
    peer_config()    -> PeerConfig    (kvstore/peer/cluster.py), built even without etcd to check the settings
    kv_events_config() -> KvEventsConfig (kvstore/server/kv_events/config.py), built with kv_events off too

checks.validate(cfg) runs every rule once: the components' (by building them), the factories' (policy,
admission) and the ones that tie parts together (rules.py, security.py). Each rule lives in exactly one of those
places; this module imports none of them (they read a ServerConfig: the imports point one way).
"""

from __future__ import annotations

import re
import socket
from dataclasses import MISSING, dataclass, field
from typing import Any

from kvstore.engine.config import EngineConfig
from kvstore.fastpath.sockets import DAEMON_SPIN_US
from kvstore.paths import default_disk_dir, default_socket_path
from kvstore.peer.cluster import COPIES, PLANES, PeerConfig
from kvstore.policies import POLICY_NAMES
from kvstore.policies.admission import ADMISSION_HELP, WRITE_HELP
from kvstore.security.etcd import EtcdSecurity
from kvstore.security.tls import TlsFiles
from kvstore.server.heap import GEN0_THRESHOLD
from kvstore.server.kv_events.config import KvEventsConfig
from kvstore.server.config.units import parse_quotas, parse_size
from kvstore.tiers.disk.config import CODECS, DiskConfig

__all__ = ["ServerConfig", "SECTIONS"]

#: section -> its title, in the order docs/configuration.md lists them
SECTIONS = {
    "node": "Node and logging",
    "listeners": "Listeners and RPC limits",
    "arena": "RAM arena",
    "engine": "Eviction, leases and reservations",
    "disk": "Disk tier",
    "peer": "Peer tier (etcd membership and data plane)",
    "security": "TLS, tokens and exposure",
    "tenancy": "Tenant quotas",
    "metrics": "Metrics",
    "restart": "Restarts that keep the RAM tier (hand-over, systemd's fd store)",
    "events": "KV events for routers (vLLM's format over ZMQ)",
}


def _s(section: str, text: str, default: Any = MISSING, *, factory: Any = MISSING, shown: str = "") -> Any:
    """A setting: its section, its help and, for a default computed at start, how the docs describe it."""
    assert section in SECTIONS, section
    meta = {"section": section, "help": text, "default_doc": shown}
    return field(default=default, default_factory=factory, metadata=meta)


@dataclass(frozen=True)
class ServerConfig:
    node_id: str = _s("node", "name of this node in logs, stats and the cluster", factory=socket.gethostname,
                       shown="the host name")
    unix_socket: str = _s("listeners", "gRPC unix socket path; '' disables it", factory=default_socket_path,
                          shown="$XDG_RUNTIME_DIR/kvstore.sock, else /tmp/kvstore-<uid>/kvstore.sock")
    listen: str = _s("listeners", "gRPC TCP address host:port; '' disables it", "127.0.0.1:7070")
    metrics_listen: str = _s("metrics", "Prometheus /metrics and /healthz host:port; '' disables", "127.0.0.1:9464")
    arena_name: str = _s("arena", "label of the arena's memory files (memfds, seen in /proc/<pid>/maps); default "
                         "/kvstore-<node_id>", "")
    arena_bytes: int = _s("arena", "RAM tier size (slots); a size like 1GiB", 1 << 30)
    arena_lock: str = _s("arena", "mlock the arena: auto (try, warn), on (required), off", "auto")
    max_block_bytes: int = _s("arena", "largest block; also the slab size of the allocator", 16 << 20)
    policy: str = _s("engine", f"eviction policy: {', '.join(POLICY_NAMES)}", "lru")
    high_watermark: float = _s("engine", "evict after a commit once this fraction is allocated", 0.95)
    low_watermark: float = _s("engine", "... down to this fraction", 0.90)
    lease_ttl_s: float = _s("engine", "seconds a read lease lives unless released", 30.0)
    reservation_ttl_s: float = _s("engine", "seconds a reservation lives unless committed", 30.0)
    quarantine_s: float = _s("engine", "seconds expired reservations wait before reuse; <0 = reservation_ttl_s", -1.0)
    disk_dir: str = _s("disk", "disk tier directory (segment files + lmdb index)", factory=default_disk_dir,
                       shown="$XDG_CACHE_HOME/kvstore/disk, else ~/.cache/kvstore/disk")
    disk_bytes: int = _s("disk", "disk tier capacity; 0 disables the disk tier", 8 << 30)
    disk_segment_bytes: int = _s("disk", "disk segment file size (the unit of disk eviction)", 256 << 20)
    disk_sync: str = _s("disk", "data: fdatasync before the index commit (crash-safe); none: no fsync", "data")
    disk_codec: str = _s("disk", f"default disk compression: {', '.join(CODECS)} (zstd-shuffle2: bf16 KV)", "none")
    disk_admission: str = _s("disk", "which blocks get a disk copy: " + ADMISSION_HELP, "always")
    disk_write: str = _s("disk", WRITE_HELP + "; evict: RAM and disk hold mostly different blocks (more hits at the "
                         "same sizes, fewer writes: docs/benchmarks.md), but blocks only in RAM die with the daemon",
                         "evict")
    disk_write_budget: str = _s("disk", "SSD write budget in bytes per second, averaged over "
                                "disk_write_budget_window_s, e.g. '200MiB': blocks are admitted at random with a "
                                "probability that follows it (CacheLib's dynamic random admission), larger blocks "
                                "refused first; written, refused and the budget's state are in Stats and /metrics; "
                                "'' = no budget", "")
    disk_write_budget_window_s: float = _s("disk", "the span the disk write budget is averaged over, in seconds "
                                           "(1..86400)", 60.0)
    disk_wipe: bool = _s("disk", "empty the disk tier at start instead of serving what it holds", False)
    disk_probe_interval_s: float = _s("disk", "how often a degraded disk tier is retried", 5.0)
    promote_timeout_s: float = _s("disk", "how long a get waits for blocks read back from disk", 5.0)
    write_queue_blocks: int = _s("disk", "bound of the disk write-behind queue, in blocks", 4096)
    disk_reinsert_hits: int = _s("disk", "second chance: a disk record read at least this many times since its "
                                 "write is kept (copied to the log's head) when its segment is reclaimed; 0 = plain "
                                 "FIFO", 1)
    max_batch_keys: int = _s("listeners", "most keys one RPC may carry", 4096)
    fast_spin_us: int = _s("listeners", "same-node socket: while a client's calls come this close together (us), "
                           "its connection thread polls for the next one instead of sleeping (saves a wake-up, "
                           "20-30 us on a VM; at most one polling thread per 8 CPUs); 0 never polls", DAEMON_SPIN_US)
    key_index_entries: int = _s("listeners", "same-node socket: RAM blocks per tenant the shared key index holds "
                                "(clients answer a Lookup without lease of blocks all there themselves, and find a "
                                "probe's leading blocks there; 96 bytes of shared memory a block, allocated and mapped at start like the arena); "
                                "blocks past it are probed the usual way; 0 turns the index off", 262144)
    max_message_bytes: int = _s("listeners", "largest gRPC message", 64 << 20)
    sweep_interval_s: float = _s("engine", "how often leases and reservations are checked for expiry", 0.25)
    miss_ledger_keys: int = _s("engine", "keys that left the store (evicted, deleted, reclaimed) remembered with "
                               "when and why, to give each miss a cause (~200 bytes a key); 0 keeps none", 262144)
    claim_keys: int = _s("engine", "keys vLLM schedulers may hold claims on at once: a scheduler that misses "
                         "claims the keys it will compute, and another one that misses them meanwhile waits for its "
                         "save instead of computing them too (~250 bytes a key); 0 records no claim", 1 << 18)
    hint_max_ttl_s: float = _s("engine", "longest Retain or Pin an agent hint may ask for, in seconds; a longer "
                               "ttl is clipped to it (outcome 'clipped')", 600.0)
    session_book_max: int = _s("engine", "agent sessions (x shard namespaces) whose latest chain of keys the daemon "
                               "keeps for `kvstore explain --session` (the vLLM connector notes them); the least "
                               "recently noted goes first; ~400 bytes each plus keys; 0 keeps none", 4096)
    session_book_keys: int = _s("engine", "keys over all sessions of the session book (~60-110 bytes a key); the "
                                "least recently noted sessions go to make room", 262144)
    grpc_workers: int = _s("listeners", "gRPC server threads (event subscribers hold one each)", 16)
    max_subscribers: int = _s("listeners", "most concurrent KV-event subscribers", 4)
    etcd_endpoints: str = _s("peer", "peer tier: comma-separated etcd v3 client URLs (https://host:2379 with "
                             "etcd_ca; a plain http:// etcd on another host is refused unless allow_insecure_remote "
                             "= true); '' runs this node alone (etcd_* and peer_* settings are then not read)", "")
    etcd_prefix: str = _s("peer", "etcd key prefix under which members register", "/kvstore/members/")
    etcd_ca: str = _s("peer", "PEM CA bundle that signed etcd's certificate (https:// endpoints; its host name or "
                      "IP is checked too); '' = the system CA store", "")
    etcd_cert: str = _s("peer", "PEM client certificate for etcd --client-cert-auth (with etcd's auth on: one "
                        "without a CommonName)", "")
    etcd_key: str = _s("peer", "PEM private key of etcd_cert (must be owner-only, mode 0600)", "")
    etcd_user: str = _s("peer", "etcd user to log in as (etcd auth on); its role needs readwrite on etcd_prefix; "
                        "'' = no login", "")
    etcd_password_file: str = _s("peer", "owner-only file whose first line is etcd_user's password (never a flag); "
                                 "read at each login", "")
    peer_listen: str = _s("peer", "peer data plane host:port (TCP or UCX listener)", "127.0.0.1:7071")
    peer_advertise: str = _s("peer", "data address peers dial, this node's host:port (Kubernetes: $(HOST_IP):7071 "
                             "from the downward API); '' = peer_listen, which then must name one address, not 0.0.0.0",
                             "")
    peer_control_advertise: str = _s("peer", "gRPC address peers see in the member set (the grpc data plane calls "
                                     "it, `kvstore inspect` asks it); '' = listen ('' too: none)", "")
    peer_lease_ttl_s: float = _s("peer", "TTL of this node's etcd lease: a dead node leaves after it", 5.0)
    peer_refresh_s: float = _s("peer", "how often this node's etcd lease is renewed (the member set is watched: a "
                               "change is seen at once); also the retry interval while etcd is down", 0.5)
    peer_replication: str = _s("peer", f"push after a put: {', '.join(COPIES)} (owner and one replica)", "owner")
    peer_data_plane: str = _s("peer", f"peer data plane: {', '.join(PLANES)} (tcp: framed, zero-copy; ucx: ucxx)",
                              "tcp")
    peer_timeout_s: float = _s("peer", "bound on one batched call to a peer; past it the keys are misses", 2.0)
    peer_push_queue_blocks: int = _s("peer", "bound of the background push queue; beyond it pushes drop", 4096)
    peer_idle_timeout_s: float = _s("peer", "a peer data connection idle this long is closed (both ends)", 60.0)
    peer_handoff_bytes_per_s: int = _s("peer", "after a membership change, the rate at which this node hands blocks "
                                       "to their new owners (bytes/s, 1 s of burst)", 1 << 30)
    peer_handoff_intake_bytes_per_s: int = _s("peer", "the rate of hand-offs this node takes in from all peers "
                                              "(bytes/s); a hand-off frame past it is refused whole and counted",
                                              4 << 30)
    peer_handoff_window_s: float = _s("peer", "after a membership change, how long a read that misses at a block's "
                                      "owner also asks its previous owners (until the hand-off lands)", 120.0)
    peer_local_copies: str = _s("peer", "RAM copies of blocks this node does not own, once their owner has them (its "
                                "own puts once pushed, blocks fetched from peers once read, blocks handed to a new "
                                "owner): drop = freed now, so the cluster's RAM holds each block once; guest = "
                                "first to go; keep = ordinary entries", "drop")
    peer_leave_timeout_s: float = _s("peer", "on SIGTERM, the longest this node spends handing its blocks to their "
                                     "next owners before it leaves the cluster; 0 leaves at once", 20.0)
    tls_cert: str = _s("security", "PEM certificate chain: TLS on the TCP gRPC listener and the peer data plane", "")
    tls_key: str = _s("security", "PEM private key of tls_cert (must be owner-only, mode 0600)", "")
    tls_ca: str = _s("security", "PEM CA bundle: gRPC clients must present a certificate it signed (mutual TLS); "
                     "required by the peer plane", "")
    allow_insecure_remote: bool = _s("security", "allow a non-loopback gRPC or peer listener without TLS (logs a "
                                     "warning), and a plain http:// etcd on another host; off: both are refused",
                                     False)
    tokens_file: str = _s("security", "owner-only file of `tenant token` lines; every RPC then needs "
                          "`authorization: Bearer <token>`; '' = no tokens", "")
    tenant_ram_quota: str = _s("tenancy", "guaranteed RAM bytes per tenant, e.g. 'alice=8GiB,bob=2GiB,*=1GiB' ('*': "
                               "every other tenant); another tenant's burst never evicts a tenant below its quota; "
                               "'' = no quotas", "")
    tenant_disk_quota: str = _s("tenancy", "guaranteed disk-tier bytes per tenant, same form as tenant_ram_quota; "
                                "kept at segment reclamation (copied forward), so the total must fit in disk_bytes "
                                "- 2 segments; '' = no quotas", "")
    metrics_namespace_labels: str = _s("metrics", "namespace and tenant label values on /metrics: name, hash (keyed "
                                       "HMAC: no name leaves the node), none (per-namespace and per-tenant series "
                                       "dropped, totals kept); auto = hash with tokens_file, else name", "auto")
    metrics_label_key_file: str = _s("metrics", "owner-only file with the hash labels' secret key (>= 16 bytes): "
                                     "labels stay the same across restarts and on every node sharing it; '' = a "
                                     "random key each start (labels unlinkable across restarts)", "")
    take_over: bool = _s("restart", "start by taking over the daemon running on unix_socket: its arena memory, "
                         "catalog, leases, sessions and listening sockets come over its hand-over socket "
                         "(<unix_socket>.handover) and it exits; no block is copied (docs/operations.md). With no "
                         "daemon there, start as usual; with another arena geometry or version, it stops and this "
                         "one starts cold (the log says why). A running daemon does the same for a successor it "
                         "starts itself on SIGUSR2", False)
    handover_timeout_s: float = _s("restart", "the longest a hand-over waits for the other side at any step; past "
                                   "it the running daemon keeps (or goes back to) serving. Hashing every block to "
                                   "check it runs at several GB/s: raise it for arenas of hundreds of GiB", 60.0)
    handover_linger: bool = _s("restart", "after handing over, stay alive (holding nothing, serving nothing) until "
                               "SIGTERM instead of exiting: for supervisors that restart a process that exits, such "
                               "as a Kubernetes DaemonSet's surge update (deploy/kubernetes)", False)
    fdstore: str = _s("restart", "keep the arena's memory files in systemd's file descriptor store, so that a "
                      "restart by systemd (or after a crash) serves the RAM blocks that verify: auto (when "
                      "$NOTIFY_SOCKET is set), on (required), off. Under the store, blocks committed without an "
                      "xxh3 are hashed in the background (a crash keeps only blocks it can check)", "auto")
    kv_events: bool = _s("events", "publish what this node holds, per tier, as vLLM's KV events (BlockStored, "
                         "BlockRemoved, AllBlocksCleared; msgpack as vLLM 0.33) on a ZMQ socket, with vLLM's block "
                         "hashes where the connector sent them (needs pip install kvstore[events])", False)
    kv_events_endpoint: str = _s("events", "ZMQ endpoint the daemon binds for subscribers: tcp://HOST:PORT or "
                                 "ipc:///PATH; a host other than loopback needs allow_insecure_remote (the stream "
                                 "has no authentication)", "tcp://127.0.0.1:5557")
    kv_events_replay_endpoint: str = _s("events", "ZMQ ROUTER endpoint for replays of missed batches, as vLLM's (a "
                                        "request is the first sequence wanted, 8 bytes big-endian; [topic, start] "
                                        "with several topics); '' = none", "")
    kv_events_topic: str = _s("events", "topic of a namespace's events: a template of {node}, {model} (its "
                              "registered model, else its name), {namespace}, {tenant}; '' = one topic, as vLLM's "
                              "default", "kv@{node}@{model}")
    kv_events_buffer_batches: int = _s("events", "batches kept per topic for replay", 10_000)
    kv_events_hwm: int = _s("events", "batches queued for one subscriber; once its queue is full it loses "
                            "batches until it reads again (the stall is counted; the others get them)", 100_000)
    kv_events_queue: int = _s("events", "store events waiting for the publisher; past it they are lost (counted), "
                              "and subscribers get AllBlocksCleared and what the store holds now", 100_000)
    log_level: str = _s("node", "debug, info, warning, error", "info")
    log_format: str = _s("node", "text or json (one object a line)", "text")
    gc_young_threshold: int = _s("node", "Python's young-generation collection threshold once serving, after "
                                 "freezing the objects built at startup (no pass walks them again): fewer collector "
                                 "pauses in Lookups (python -m bench.gc_pauses); 0 keeps CPython's defaults (700, "
                                 "nothing frozen)", GEN0_THRESHOLD)

    # -- derived values ---------------------------------------------------------------------------------------
    @property
    def shm_name(self) -> str:
        if self.arena_name:
            return self.arena_name
        return "/kvstore-" + re.sub(r"[^A-Za-z0-9._-]", "_", self.node_id)

    @property
    def effective_quarantine_s(self) -> float:
        return self.reservation_ttl_s if self.quarantine_s < 0 else self.quarantine_s

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def etcd_security(self) -> EtcdSecurity:
        return EtcdSecurity(self.etcd_ca, self.etcd_cert, self.etcd_key, self.etcd_user, self.etcd_password_file)

    @property
    def ram_quotas(self) -> dict[str, int]:
        return parse_quotas(self.tenant_ram_quota, "tenant_ram_quota")

    @property
    def disk_quotas(self) -> dict[str, int]:
        return parse_quotas(self.tenant_disk_quota, "tenant_disk_quota")

    @property
    def write_budget(self) -> int | None:
        """disk_write_budget in bytes per second; None for no budget ('')."""
        text = self.disk_write_budget.strip()
        if not text:
            return None
        return parse_size(text.removesuffix("/s"), "disk_write_budget")

    @property
    def peer_endpoints(self) -> list[str]:
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    @property
    def metrics_labels(self) -> str:
        """The effective label mode: name, hash or none ('auto' resolved against tokens_file)."""
        if self.metrics_namespace_labels == "auto":
            return "hash" if self.tokens_file else "name"
        return self.metrics_namespace_labels

    # -- the parts it builds ----------------------------------------------------------------------------------
    def engine_config(self) -> EngineConfig:
        """The engine's settings; with tokens every tenant's slots live in a memory file of its own."""
        return EngineConfig(
            max_block_bytes=self.max_block_bytes, max_batch_keys=self.max_batch_keys,
            high_watermark=self.high_watermark, low_watermark=self.low_watermark,
            lease_ttl_s=self.lease_ttl_s, reservation_ttl_s=self.reservation_ttl_s,
            quarantine_s=self.effective_quarantine_s, promote_timeout_s=self.promote_timeout_s,
            write_queue_blocks=self.write_queue_blocks, disk_codec=self.disk_codec,
            probe_interval_s=self.disk_probe_interval_s, isolate_tenants=bool(self.tokens_file),
            miss_ledger_keys=self.miss_ledger_keys, hint_max_ttl_s=self.hint_max_ttl_s,
            claim_keys=self.claim_keys,
        )

    def disk_config(self) -> DiskConfig | None:
        """The disk tier's settings, or None when disk_bytes = 0 (no disk tier)."""
        if not self.disk_bytes:
            return None
        return DiskConfig(directory=self.disk_dir, capacity_bytes=self.disk_bytes,
                          segment_bytes=self.disk_segment_bytes, sync=self.disk_sync, compression=self.disk_codec,
                          probe_interval_s=self.disk_probe_interval_s, reinsert_hits=self.disk_reinsert_hits)

    def kv_events_config(self) -> KvEventsConfig:
        """The vLLM-format event publisher's settings (built, and so checked, with kv_events off too)."""
        return KvEventsConfig(node_id=self.node_id, endpoint=self.kv_events_endpoint,
                              replay_endpoint=self.kv_events_replay_endpoint, topic=self.kv_events_topic,
                              buffer_batches=self.kv_events_buffer_batches, hwm=self.kv_events_hwm,
                              queue_events=self.kv_events_queue)

    def peer_config(self, capacity_bytes: int = 0) -> PeerConfig:
        """The peer tier's settings; `capacity_bytes` (what this node offers the cluster) is known to the daemon
        once the arena is laid out."""
        return PeerConfig(
            node_id=self.node_id, etcd_endpoints=tuple(self.peer_endpoints), etcd_prefix=self.etcd_prefix,
            listen=self.peer_listen, advertise=self.peer_advertise,
            control_address=self.peer_control_advertise or self.listen, lease_ttl_s=self.peer_lease_ttl_s,
            refresh_s=self.peer_refresh_s, replication=self.peer_replication, data_plane=self.peer_data_plane,
            timeout_s=self.peer_timeout_s, push_queue_blocks=self.peer_push_queue_blocks,
            idle_timeout_s=self.peer_idle_timeout_s, max_keys=self.max_batch_keys,
            handoff_bytes_per_s=self.peer_handoff_bytes_per_s,
            handoff_intake_bytes_per_s=self.peer_handoff_intake_bytes_per_s,
            handoff_window_s=self.peer_handoff_window_s, leave_timeout_s=self.peer_leave_timeout_s,
            local_copies=self.peer_local_copies,
            max_block_bytes=self.max_block_bytes, capacity_bytes=capacity_bytes,
            tls=self.tls if self.tls.enabled else None, etcd_security=self.etcd_security,
        )
