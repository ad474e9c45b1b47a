"""The daemon's one typed config, read from embedded defaults < a TOML file < KVSTORE_* env < flags.

Each field of `ServerConfig` is at once a TOML key (`arena_bytes = "4GiB"`), an environment variable
(`KVSTORE_ARENA_BYTES=4GiB`) and a flag (`--arena-bytes 4GiB`), so the three can never drift apart. Every
value is validated here, before anything is created, and a bad one stops the daemon with a message that names
the setting, the value and what would be accepted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from kvstore.errors import ConfigError
from kvstore.security.etcd import EtcdSecurity
from kvstore.security.tls import TlsFiles, is_loopback_address, is_loopback_host
from kvstore.server.metric_labels import read_label_key
from kvstore.security.tokens import TENANT_RE, TokenTable
from kvstore.paths import default_disk_dir, default_socket_path
from kvstore.policies.admission import ADMISSION_HELP, make_admission
from kvstore.policies import POLICY_NAMES

__all__ = ["ServerConfig", "load_config", "parse_size", "build_arg_parser"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(value: str | int, name: str = "size") -> int:
    """'1GiB', '512 MiB', '4096' or an int -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size such as '1GiB', got {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot read {value!r} as a size; use e.g. 4096, '512MiB', '1GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_quotas(text: str, name: str) -> dict[str, int]:
    """'alice=8GiB, bob=2GiB, *=1GiB' -> {'alice': ..., 'bob': ..., '*': ...}."""
    out: dict[str, int] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        tenant, sep, size = item.partition("=")
        tenant = tenant.strip()
        if not sep or not (tenant == "*" or TENANT_RE.match(tenant)):
            raise ConfigError(f"{name}: cannot read {item!r}; use tenant=size pairs, e.g. 'alice=8GiB,*=1GiB'")
        if tenant in out:
            raise ConfigError(f"{name}: tenant {tenant!r} given twice")
        out[tenant] = parse_size(size.strip(), f"{name} of {tenant}")
    return out


def _help(text: str, **kw: object) -> dict:
    return {"metadata": {"help": text}, **kw}


@dataclass(frozen=True)
class ServerConfig:
    node_id: str = field(default_factory=socket.gethostname, **_help("name of this node in logs, stats and (later) the cluster"))
    unix_socket: str = field(default_factory=default_socket_path, **_help("gRPC unix socket path; '' disables it"))
    listen: str = field(default="127.0.0.1:7070", **_help("gRPC TCP address host:port; '' disables it"))
    metrics_listen: str = field(default="127.0.0.1:9464", **_help("Prometheus /metrics and /healthz host:port; '' disables"))
    arena_name: str = field(default="", **_help("label of the arena's memory files (memfds, seen in /proc/<pid>/maps); default /kvstore-<node_id>"))
    arena_bytes: int = field(default=1 << 30, **_help("RAM tier size (slots); a size like 1GiB"))
    arena_lock: str = field(default="auto", **_help("mlock the arena: auto (try, warn), on (required), off"))
    max_block_bytes: int = field(default=16 << 20, **_help("largest block; also the slab size of the allocator"))
    policy: str = field(default="lru", **_help(f"eviction policy: {', '.join(POLICY_NAMES)}"))
    high_watermark: float = field(default=0.95, **_help("evict after a commit once this fraction is allocated"))
    low_watermark: float = field(default=0.90, **_help("... down to this fraction"))
    lease_ttl_s: float = field(default=30.0, **_help("seconds a read lease lives unless released"))
    reservation_ttl_s: float = field(default=30.0, **_help("seconds a reservation lives unless committed"))
    quarantine_s: float = field(default=-1.0, **_help("seconds expired reservations wait before reuse; <0 = reservation_ttl_s"))
    disk_dir: str = field(default_factory=default_disk_dir, **_help("disk tier directory (segment files + lmdb index)"))
    disk_bytes: int = field(default=8 << 30, **_help("disk tier capacity; 0 disables the disk tier"))
    disk_segment_bytes: int = field(default=256 << 20, **_help("disk segment file size (the unit of disk eviction)"))
    disk_sync: str = field(default="data", **_help("data: fdatasync before the index commit (crash-safe); none: no fsync"))
    disk_codec: str = field(default="none", **_help("default disk compression: none, zstd, zstd-shuffle2 (bf16 KV)"))
    disk_admission: str = field(default="always", **_help("which blocks get a disk copy: " + ADMISSION_HELP))
    disk_wipe: bool = field(default=False, **_help("empty the disk tier at start instead of serving what it holds"))
    disk_probe_interval_s: float = field(default=5.0, **_help("how often a degraded disk tier is retried"))
    promote_timeout_s: float = field(default=5.0, **_help("how long a get waits for blocks read back from disk"))
    write_queue_blocks: int = field(default=4096, **_help("bound of the disk write-behind queue, in blocks"))
    disk_reinsert_hits: int = field(default=1, **_help(
        "second chance: a disk record read at least this many times since its write is kept (copied to the log's "
        "head) when its segment is reclaimed; 0 = plain FIFO"))
    max_batch_keys: int = field(default=4096, **_help("most keys one RPC may carry"))
    max_message_bytes: int = field(default=64 << 20, **_help("largest gRPC message"))
    sweep_interval_s: float = field(default=0.25, **_help("how often leases and reservations are checked for expiry"))
    grpc_workers: int = field(default=16, **_help("gRPC server threads (event subscribers hold one each)"))
    max_subscribers: int = field(default=4, **_help("most concurrent KV-event subscribers"))
    etcd_endpoints: str = field(default="", **_help(
        "peer tier: comma-separated etcd v3 client URLs (https://host:2379 with etcd_ca; http:// on loopback or "
        "a trusted network); '' runs this node alone"))
    etcd_prefix: str = field(default="/kvstore/members/", **_help("etcd key prefix under which members register"))
    etcd_ca: str = field(default="", **_help(
        "PEM CA bundle that signed etcd's certificate (https:// endpoints; its host name or IP is checked too); "
        "'' = the system CA store"))
    etcd_cert: str = field(default="", **_help(
        "PEM client certificate for etcd --client-cert-auth (with etcd's auth on: one without a CommonName)"))
    etcd_key: str = field(default="", **_help("PEM private key of etcd_cert (must be owner-only, mode 0600)"))
    etcd_user: str = field(default="", **_help(
        "etcd user to log in as (etcd auth on); its role needs readwrite on etcd_prefix; '' = no login"))
    etcd_password_file: str = field(default="", **_help(
        "owner-only file whose first line is etcd_user's password (never a flag); read at each login"))
    peer_listen: str = field(default="127.0.0.1:7071", **_help("peer data plane host:port (TCP or UCX listener)"))
    peer_advertise: str = field(default="", **_help("data address peers dial; '' = peer_listen"))
    peer_control_advertise: str = field(default="", **_help("gRPC address peers see in the member set; '' = listen"))
    peer_lease_ttl_s: float = field(default=5.0, **_help("TTL of this node's etcd lease: a dead node leaves after it"))
    peer_refresh_s: float = field(default=0.5, **_help("how often the member set is re-read and the lease kept alive"))
    peer_replication: str = field(default="owner", **_help("push after a put: off, owner, owner+1 (owner and one replica)"))
    peer_data_plane: str = field(default="tcp", **_help("peer data plane: tcp (framed, zero-copy), ucx (ucxx), grpc"))
    peer_timeout_s: float = field(default=2.0, **_help("bound on one batched call to a peer; past it the keys are misses"))
    peer_push_queue_blocks: int = field(default=4096, **_help("bound of the background push queue; beyond it pushes drop"))
    peer_idle_timeout_s: float = field(default=60.0, **_help("a peer data connection idle this long is closed (both ends)"))
    tls_cert: str = field(default="", **_help("PEM certificate chain: TLS on the TCP gRPC listener and the peer data plane"))
    tls_key: str = field(default="", **_help("PEM private key of tls_cert (must be owner-only, mode 0600)"))
    tls_ca: str = field(default="", **_help(
        "PEM CA bundle: gRPC clients must present a certificate it signed (mutual TLS); required by the peer plane"))
    allow_insecure_remote: bool = field(default=False, **_help(
        "allow a non-loopback gRPC or peer listener without TLS (logs a warning); off: such a listener is refused"))
    tokens_file: str = field(default="", **_help(
        "owner-only file of `tenant token` lines; every RPC then needs `authorization: Bearer <token>`; '' = no tokens"))
    tenant_ram_quota: str = field(default="", **_help(
        "guaranteed RAM bytes per tenant, e.g. 'alice=8GiB,bob=2GiB,*=1GiB' ('*': every other tenant); another "
        "tenant's burst never evicts a tenant below its quota; '' = no quotas"))
    tenant_disk_quota: str = field(default="", **_help(
        "guaranteed disk-tier bytes per tenant, same form as tenant_ram_quota; kept at segment reclamation (copied "
        "forward), so the total must fit in disk_bytes - 2 segments; '' = no quotas"))
    metrics_namespace_labels: str = field(default="auto", **_help(
        "namespace and tenant label values on /metrics: name, hash (keyed HMAC: no name leaves the node), none "
        "(per-namespace and per-tenant series dropped, totals kept); auto = hash with tokens_file, else name"))
    metrics_label_key_file: str = field(default="", **_help(
        "owner-only file with the hash labels' secret key (>= 16 bytes): labels stay the same across restarts "
        "and on every node sharing it; '' = a random key each start (labels unlinkable across restarts)"))
    log_level: str = field(default="info", **_help("debug, info, warning, error"))
    log_format: str = field(default="text", **_help("text or json (one object a line)"))

    @property
    def shm_name(self) -> str:
        if self.arena_name:
            return self.arena_name
        return "/kvstore-" + re.sub(r"[^A-Za-z0-9._-]", "_", self.node_id)

    @property
    def effective_quarantine_s(self) -> float:
        return self.reservation_ttl_s if self.quarantine_s < 0 else self.quarantine_s

    def validate(self) -> ServerConfig:
        _require(bool(self.unix_socket or self.listen), "unix_socket and listen are both empty: enable at least one")
        if self.listen:
            host, _, port = self.listen.rpartition(":")
            _require(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                     f"listen={self.listen!r}: use host:port, e.g. 127.0.0.1:7070")
        if self.metrics_listen:
            host, _, port = self.metrics_listen.rpartition(":")
            _require(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                     f"metrics_listen={self.metrics_listen!r}: use host:port, e.g. 127.0.0.1:9464")
        _require(self.arena_lock in ("auto", "on", "off"), f"arena_lock={self.arena_lock!r}: use auto, on or off")
        _require(self.policy in POLICY_NAMES, f"policy={self.policy!r}: use one of {', '.join(POLICY_NAMES)}")
        _require(self.max_block_bytes >= 4096 and self.max_block_bytes % 4096 == 0,
                 f"max_block_bytes={self.max_block_bytes}: use a multiple of 4096 (e.g. 16MiB)")
        _require(self.arena_bytes >= 2 * self.max_block_bytes,
                 f"arena_bytes={self.arena_bytes} must be at least 2 x max_block_bytes ({self.max_block_bytes})")
        _require(0 < self.low_watermark <= self.high_watermark <= 1,
                 f"watermarks low={self.low_watermark} high={self.high_watermark}: need 0 < low <= high <= 1")
        for name in ("lease_ttl_s", "reservation_ttl_s", "sweep_interval_s"):
            _require(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be > 0")
        _require(1 <= self.max_batch_keys <= 65536, f"max_batch_keys={self.max_batch_keys}: use 1..65536")
        _require(self.max_message_bytes >= 1 << 20, "max_message_bytes must be at least 1MiB")
        _require(1 <= self.grpc_workers <= 256, f"grpc_workers={self.grpc_workers}: use 1..256")
        _require(0 <= self.max_subscribers < self.grpc_workers,
                 f"max_subscribers={self.max_subscribers} must be below grpc_workers={self.grpc_workers}")
        _require(self.log_level in ("debug", "info", "warning", "error"), f"log_level={self.log_level!r}: use debug, info, warning or error")
        _require(self.log_format in ("text", "json"), f"log_format={self.log_format!r}: use text or json")
        if self.disk_bytes:
            _require(bool(self.disk_dir), "disk_dir is empty: give a directory or set disk_bytes = 0")
            _require(self.disk_segment_bytes >= 1 << 20 and self.disk_segment_bytes % (1 << 20) == 0,
                     f"disk_segment_bytes={self.disk_segment_bytes}: use a multiple of 1MiB")
            _require(self.disk_segment_bytes >= self.max_block_bytes,
                     "disk_segment_bytes must be at least max_block_bytes")
            _require(self.disk_bytes >= 2 * self.disk_segment_bytes,
                     f"disk_bytes={self.disk_bytes} must hold at least 2 segments of {self.disk_segment_bytes}")
        _require(self.disk_sync in ("data", "none"), f"disk_sync={self.disk_sync!r}: use data or none")
        _require(self.disk_codec in ("none", "zstd", "zstd-shuffle2"),
                 f"disk_codec={self.disk_codec!r}: use none, zstd or zstd-shuffle2")
        make_admission(self.disk_admission)
        _require(self.disk_probe_interval_s > 0, f"disk_probe_interval_s={self.disk_probe_interval_s} must be > 0")
        _require(self.promote_timeout_s > 0, f"promote_timeout_s={self.promote_timeout_s} must be > 0")
        _require(1 <= self.write_queue_blocks <= 1 << 20, f"write_queue_blocks={self.write_queue_blocks}: use 1..1048576")
        _require(0 <= self.disk_reinsert_hits <= 255,
                 f"disk_reinsert_hits={self.disk_reinsert_hits}: use 0 (plain FIFO) .. 255, e.g. 1")
        self._validate_peers()
        self._validate_security()
        self._validate_etcd()
        self._validate_metrics_labels()
        return self

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def ram_quotas(self) -> dict[str, int]:
        return parse_quotas(self.tenant_ram_quota, "tenant_ram_quota")

    @property
    def disk_quotas(self) -> dict[str, int]:
        return parse_quotas(self.tenant_disk_quota, "tenant_disk_quota")

    def _validate_disk_quotas(self, tenants: set[str]) -> None:
        """The disk tier can protect at most disk_bytes - 2 segments (tiers/disk/floors.py); '*' counts once per
        tenant of the tokens file not named, or once without tokens."""
        quotas = self.disk_quotas
        if not quotas:
            return
        _require(self.disk_bytes > 0, "tenant_disk_quota needs the disk tier: set disk_bytes or drop the quotas")
        named = {t: n for t, n in quotas.items() if t != "*"}
        others = len(tenants - named.keys()) if tenants else 1
        total = sum(named.values()) + quotas.get("*", 0) * others
        limit = (self.disk_bytes // self.disk_segment_bytes - 2) * self.disk_segment_bytes
        _require(total <= limit,
                 f"tenant_disk_quota guarantees {total} bytes in all ('*' counted for {others} tenant(s)), more than "
                 f"the disk tier can protect: {limit} bytes (disk_bytes less 2 segments of {self.disk_segment_bytes})"
                 ": lower the quotas or raise disk_bytes")

    def _validate_security(self) -> None:
        """TLS files readable (key owner-only), tokens file owner-only and well-formed, and no listener that
        other hosts can reach without TLS unless allow_insecure_remote says so."""
        tls = self.tls
        if tls.enabled:
            tls.check("tls", need_identity=True, need_ca=False)
        tenants = TokenTable.load(self.tokens_file).tenants if self.tokens_file else set()
        self.ram_quotas  # parse errors surface now
        self._validate_disk_quotas(tenants)
        if self.listen and not is_loopback_address(self.listen) and not tls.enabled:
            _require(self.allow_insecure_remote,
                     f"listen={self.listen!r} is reachable from other hosts and TLS is off: set tls_cert and tls_key "
                     "(and tls_ca for mutual TLS), listen on 127.0.0.1, or set allow_insecure_remote = true "
                     "on a trusted network")
        if self.peer_endpoints:
            if tls.enabled:
                tls.check("peer data plane", need_identity=True, need_ca=True)
                _require(self.peer_data_plane == "tcp",
                         f"peer_data_plane={self.peer_data_plane!r} has no TLS support here: use tcp with TLS")
            elif not is_loopback_address(self.peer_listen):
                _require(self.allow_insecure_remote,
                         f"peer_listen={self.peer_listen!r} is reachable from other hosts and TLS is off: set "
                         "tls_cert, tls_key and tls_ca (the peer plane is mutual TLS), or allow_insecure_remote = true")
            _require(not (self.tokens_file and self.peer_data_plane == "grpc"),
                     "peer_data_plane = 'grpc' calls peers' gRPC port without a token: with tokens_file use tcp")
            # The data plane carries no tenant token: peers authenticate as nodes, by certificate. Without TLS any
            # local process could fetch another tenant's blocks from the peer port, so tokens need mutual TLS there.
            _require(not self.tokens_file or tls.enabled or self.allow_insecure_remote,
                     "tokens_file with a peer tier needs mutual TLS on the peer data plane (its frames carry no token; "
                     "nodes authenticate by certificate): set tls_cert, tls_key and tls_ca, or "
                     "allow_insecure_remote = true on a host where every local user may read every tenant's blocks")

    @property
    def etcd_security(self) -> EtcdSecurity:
        return EtcdSecurity(self.etcd_ca, self.etcd_cert, self.etcd_key, self.etcd_user, self.etcd_password_file)

    def _validate_etcd(self) -> None:
        """etcd holds the member set, i.e. where peers send blocks: it is reached as securely as the rest of the
        node. TLS files only with https://, halves together, secrets owner-only. A plaintext etcd on another
        host (anyone on the path can rewrite the member set, or read etcd_user's password) is refused when the
        node is otherwise protected (TLS, tokens, an etcd login) unless allow_insecure_remote says so: it would
        undo that protection. A node with none of them is open anyway (its plaintext peer listener off loopback
        needs allow_insecure_remote already), so its etcd URL is left as it was."""
        sec = self.etcd_security
        if not self.peer_endpoints:
            _require(not (sec.tls_files_given or sec.user or sec.password_file),
                     "etcd_ca / etcd_cert / etcd_key / etcd_user / etcd_password_file are set but etcd_endpoints "
                     "is empty: set etcd_endpoints (https://host:2379) or drop them")
            return
        sec.check()
        schemes = {url.split("://", 1)[0] for url in self.peer_endpoints}
        _require(len(schemes) == 1, f"etcd_endpoints={self.etcd_endpoints!r} mixes http:// and https://: use "
                 "https:// for every member (one etcd_ca verifies them all)")
        if schemes == {"https"}:
            sec.ssl_context()  # a PEM file that does not load fails now, not at the first tick
            return
        _require(not sec.tls_files_given,
                 f"etcd_ca / etcd_cert / etcd_key apply to https:// endpoints, but etcd_endpoints="
                 f"{self.etcd_endpoints!r} is plain http: use https:// URLs")
        remote = [url for url in self.peer_endpoints if not is_loopback_host(urlsplit(url).hostname or "")]
        protected = [name for name, on in (("tls_cert", self.tls.enabled), ("tokens_file", bool(self.tokens_file)),
                                           ("etcd_user", bool(sec.user))) if on]
        _require(not (remote and protected) or self.allow_insecure_remote,
                 f"etcd_endpoints {remote} are plain http to another host while this node is protected by "
                 f"{', '.join(protected)}: anyone on the path could rewrite the member set (or read etcd_user's "
                 "password); use https:// with etcd_ca (and etcd_cert/etcd_key or etcd_user), or "
                 "allow_insecure_remote = true on a trusted network")

    @property
    def metrics_labels(self) -> str:
        """The effective label mode: name, hash or none ('auto' resolved against tokens_file)."""
        if self.metrics_namespace_labels == "auto":
            return "hash" if self.tokens_file else "name"
        return self.metrics_namespace_labels

    def _validate_metrics_labels(self) -> None:
        _require(self.metrics_namespace_labels in ("auto", "name", "hash", "none"),
                 f"metrics_namespace_labels={self.metrics_namespace_labels!r}: use auto, name, hash or none")
        if self.metrics_label_key_file:
            _require(self.metrics_labels == "hash",
                     f"metrics_label_key_file is set but the labels are {self.metrics_labels!r} (metrics_namespace_"
                     f"labels={self.metrics_namespace_labels!r}): set metrics_namespace_labels = \"hash\" or drop it")
            read_label_key(self.metrics_label_key_file)

    @property
    def peer_endpoints(self) -> list[str]:
        return [e.strip() for e in self.etcd_endpoints.split(",") if e.strip()]

    def _validate_peers(self) -> None:
        """The peer tier's settings: checked even when etcd is not configured (inert then, but a typo should
        not wait for the day the node joins a cluster to surface)."""
        for url in self.peer_endpoints:
            _require(re.fullmatch(r"https?://[^/\s]+(:\d+)?/?", url) is not None,
                     f"etcd_endpoints: {url!r} is not an etcd client URL; use e.g. https://10.0.0.5:2379")
            _require("@" not in url, f"etcd_endpoints: {url!r} carries credentials; take them out of the URL "
                     "and use etcd_user and etcd_password_file")
        _require(self.etcd_prefix.startswith("/") and self.etcd_prefix.endswith("/"),
                 f"etcd_prefix={self.etcd_prefix!r}: use a path that starts and ends with '/', e.g. /kvstore/members/")
        _require(bool(self.listen or self.peer_control_advertise or not self.peer_endpoints),
                 "peer tier: listen is empty, so peers cannot reach this node's gRPC port; set listen or peer_control_advertise")
        for name in ("peer_listen", "peer_advertise", "peer_control_advertise"):
            value = getattr(self, name)
            if value or name == "peer_listen":
                host, _, port = value.rpartition(":")
                _require(bool(host) and port.isdigit() and 0 <= int(port) < 65536 and (int(port) > 0 or name == "peer_listen"),
                         f"{name}={value!r}: use host:port, e.g. 127.0.0.1:7071")
        _require(0.5 <= self.peer_lease_ttl_s <= 300,
                 f"peer_lease_ttl_s={self.peer_lease_ttl_s}: use 0.5..300 seconds (short: a dead node leaves sooner)")
        _require(0.05 <= self.peer_refresh_s <= self.peer_lease_ttl_s / 3,
                 f"peer_refresh_s={self.peer_refresh_s}: use 0.05..peer_lease_ttl_s/3 ({self.peer_lease_ttl_s / 3:g}) "
                 "so the lease is renewed at least three times per TTL")
        _require(self.peer_replication in ("off", "owner", "owner+1"),
                 f"peer_replication={self.peer_replication!r}: use off, owner or owner+1")
        _require(self.peer_data_plane in ("tcp", "ucx", "grpc"),
                 f"peer_data_plane={self.peer_data_plane!r}: use tcp, ucx or grpc")
        _require(0.01 <= self.peer_timeout_s <= 60,
                 f"peer_timeout_s={self.peer_timeout_s}: use 0.01..60 seconds")
        _require(1 <= self.peer_idle_timeout_s <= 3600,
                 f"peer_idle_timeout_s={self.peer_idle_timeout_s}: use 1..3600 seconds")
        _require(1 <= self.peer_push_queue_blocks <= 1 << 20,
                 f"peer_push_queue_blocks={self.peer_push_queue_blocks}: use 1..1048576")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError("invalid config: " + message)


def _coerce(f: dataclasses.Field, raw: object, source: str) -> object:
    what = f"{f.name} (from {source})"
    if f.name.endswith("_bytes"):
        return parse_size(raw, what)  # type: ignore[arg-type]
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on"):
            return True
        if str(raw).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{what}: expected true or false, got {raw!r}")
    try:
        if kind == "int":
            if isinstance(raw, bool):
                raise ValueError
            return int(raw)  # type: ignore[arg-type]
        if kind == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a {kind}, got {raw!r}") from None
    if not isinstance(raw, str):
        raise ConfigError(f"{what}: expected a string, got {raw!r}")
    return raw


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore-server",
        description="kvstore daemon: a shared-memory RAM tier for KV-cache blocks with a gRPC control plane. "
        "Every option can also be set in the TOML file given by --config or as KVSTORE_<NAME> in the environment "
        "(precedence: flag > env > file > default). Sizes take units: 4096, 512MiB, 1GiB.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with any of the settings below")
    for f in fields(ServerConfig):
        default = f.default if f.default is not dataclasses.MISSING else "(computed)"
        flag, text = "--" + f.name.replace("_", "-"), f"{f.metadata.get('help', '')} [default: {default!r}]"
        if f.type == "bool":
            p.add_argument(flag, dest=f.name, default=None, action="store_const", const="true", help=text)
        else:
            p.add_argument(flag, dest=f.name, default=None, metavar="VALUE", help=text)
    return p


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    env = os.environ if env is None else env
    args = build_arg_parser().parse_args(argv)
    values: dict[str, object] = {}
    by_name = {f.name: f for f in fields(ServerConfig)}
    if args.config:
        try:
            with open(args.config, "rb") as fh:
                table = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {args.config}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {args.config} is not valid TOML: {exc}") from exc
        unknown = sorted(set(table) - set(by_name))
        if unknown:
            raise ConfigError(f"unknown setting(s) {unknown} in {args.config}; valid: {sorted(by_name)}")
        for k, v in table.items():
            values[k] = _coerce(by_name[k], v, args.config)
    for name, f in by_name.items():
        raw = env.get("KVSTORE_" + name.upper())
        if raw is not None:
            values[name] = _coerce(f, raw, "KVSTORE_" + name.upper())
    for name, f in by_name.items():
        raw = getattr(args, name)
        if raw is not None:
            values[name] = _coerce(f, raw, "--" + name.replace("_", "-"))
    return ServerConfig(**values).validate()  # type: ignore[arg-type]
