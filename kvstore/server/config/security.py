"""Rules that keep the node as protected as its settings promise: TLS, tokens, tenant quotas, etcd, metrics labels.

These rules span parts (a listener and the TLS files, the peer tier and the tokens, etcd and every other
protection), so no single component's config can hold them; each is checked here once, by
checks.validate(). The files themselves (TLS, tokens, etcd secrets, label key) are checked by the
classes that read them (kvstore/security, server/metric_labels.py).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvstore.security.tls import is_loopback_address, is_loopback_host
from kvstore.security.tokens import TokenTable
from kvstore.server.config.rules import require
from kvstore.server.config.settings import ServerConfig
from kvstore.server.kv_events.config import endpoint_host
from kvstore.server.metric_labels import read_label_key

__all__ = ["check_security", "check_etcd", "check_metrics_labels", "check_kv_events", "unused_peer_settings"]

LABEL_MODES = ("auto", "name", "hash", "none")


def check_security(cfg: ServerConfig) -> None:
    """TLS files readable (key owner-only), tokens file owner-only and well-formed, quotas that fit, and no
    listener that other hosts can reach without TLS unless allow_insecure_remote says so."""
    tls = cfg.tls
    if tls.enabled and (cfg.listen or cfg.peer_endpoints):  # unused otherwise: see check_etcd
        tls.check("tls", need_identity=True, need_ca=False)
    tenants = TokenTable.load(cfg.tokens_file).tenants if cfg.tokens_file else set()
    _ = cfg.ram_quotas  # parse errors surface now
    _check_disk_quotas(cfg, tenants)
    if cfg.listen and not is_loopback_address(cfg.listen) and not tls.enabled:
        require(cfg.allow_insecure_remote,
                f"listen={cfg.listen!r} is reachable from other hosts and TLS is off: set tls_cert and tls_key "
                "(and tls_ca for mutual TLS), listen on 127.0.0.1, or set allow_insecure_remote = true "
                "on a trusted network")
    if not cfg.peer_endpoints:
        return
    if tls.enabled:
        tls.check("peer data plane", need_identity=True, need_ca=True)
        require(cfg.peer_data_plane == "tcp",
                f"peer_data_plane={cfg.peer_data_plane!r} has no TLS support here: use tcp with TLS")
    elif not is_loopback_address(cfg.peer_listen):
        require(cfg.allow_insecure_remote,
                f"peer_listen={cfg.peer_listen!r} is reachable from other hosts and TLS is off: set "
                "tls_cert, tls_key and tls_ca (the peer plane is mutual TLS), or allow_insecure_remote = true")
    require(not (cfg.tokens_file and cfg.peer_data_plane == "grpc"),
            "peer_data_plane = 'grpc' calls peers' gRPC port without a token: with tokens_file use tcp")
    # The data plane carries no tenant token: peers authenticate as nodes, by certificate. Without TLS any
    # local process could fetch another tenant's blocks from the peer port, so tokens need mutual TLS there.
    require(not cfg.tokens_file or tls.enabled or cfg.allow_insecure_remote,
            "tokens_file with a peer tier needs mutual TLS on the peer data plane (its frames carry no token; "
            "nodes authenticate by certificate): set tls_cert, tls_key and tls_ca, or "
            "allow_insecure_remote = true on a host where every local user may read every tenant's blocks")


def _check_disk_quotas(cfg: ServerConfig, tenants: set[str]) -> None:
    """The disk tier can protect at most disk_bytes - 2 segments (tiers/disk/floors.py); '*' counts once per
    tenant of the tokens file not named, or once without tokens."""
    quotas = cfg.disk_quotas
    if not quotas:
        return
    require(cfg.disk_bytes > 0, "tenant_disk_quota needs the disk tier: set disk_bytes or drop the quotas")
    named = {t: n for t, n in quotas.items() if t != "*"}
    others = len(tenants - named.keys()) if tenants else 1
    total = sum(named.values()) + quotas.get("*", 0) * others
    limit = (cfg.disk_bytes // cfg.disk_segment_bytes - 2) * cfg.disk_segment_bytes
    require(total <= limit,
            f"tenant_disk_quota guarantees {total} bytes in all ('*' counted for {others} tenant(s)), more than "
            f"the disk tier can protect: {limit} bytes (disk_bytes less 2 segments of {cfg.disk_segment_bytes})"
            ": lower the quotas or raise disk_bytes")


def check_etcd(cfg: ServerConfig) -> None:
    """etcd holds the member set, i.e. where peers send blocks: it is reached as securely as the rest of the
    node. TLS files only with https://, halves together, secrets owner-only, and one rule for plain http: an
    http:// endpoint on another host is refused unless allow_insecure_remote = true (anyone on the path could
    rewrite the member set, or read etcd_user's password); http:// on loopback is fine.

    Without etcd_endpoints the peer tier is off and the etcd_* settings (like peer_* and, with listen = '', the
    tls_* files) are not read: a deployment keeps them in its config, pointing into a Secret that may not be
    mounted yet, and turns the peer tier on by setting etcd_endpoints alone (deploy/). The daemon names the
    unused settings in its start log (`unused_peer_settings`)."""
    sec = cfg.etcd_security
    if not cfg.peer_endpoints:
        return
    sec.check()
    schemes = {url.split("://", 1)[0] for url in cfg.peer_endpoints}
    require(len(schemes) == 1, f"etcd_endpoints={cfg.etcd_endpoints!r} mixes http:// and https://: use "
            "https:// for every member (one etcd_ca verifies them all)")
    if schemes == {"https"}:
        sec.ssl_context()  # a PEM file that does not load fails now, not at the first tick
        return
    require(not sec.tls_files_given,
            f"etcd_ca / etcd_cert / etcd_key apply to https:// endpoints, but etcd_endpoints="
            f"{cfg.etcd_endpoints!r} is plain http: use https:// URLs")
    remote = [url for url in cfg.peer_endpoints if not is_loopback_host(urlsplit(url).hostname or "")]
    require(not remote or cfg.allow_insecure_remote,
            f"etcd_endpoints {remote} are plain http to another host: anyone on the path could rewrite the member "
            "set (or read etcd_user's password); use https:// with etcd_ca (and etcd_cert/etcd_key or "
            "etcd_user), or allow_insecure_remote = true on a trusted network")


def unused_peer_settings(cfg: ServerConfig) -> list[str]:
    """Settings given for the peer tier (etcd_*, and tls_* with no listener using them) while it is off."""
    if cfg.peer_endpoints:
        return []
    given = [name for name in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file")
             if getattr(cfg, name)]
    if not cfg.listen:
        given += [name for name in ("tls_cert", "tls_key", "tls_ca") if getattr(cfg, name)]
    return given


def check_metrics_labels(cfg: ServerConfig) -> None:
    require(cfg.metrics_namespace_labels in LABEL_MODES,
            f"metrics_namespace_labels={cfg.metrics_namespace_labels!r}: use auto, name, hash or none")
    if cfg.metrics_label_key_file:
        require(cfg.metrics_labels == "hash",
                f"metrics_label_key_file is set but the labels are {cfg.metrics_labels!r} (metrics_namespace_"
                f"labels={cfg.metrics_namespace_labels!r}): set metrics_namespace_labels = \"hash\" or drop it")
        read_label_key(cfg.metrics_label_key_file)


def check_kv_events(cfg: ServerConfig) -> None:
    """The vLLM-format event stream has no authentication (ZMQ, as vLLM's): it names every namespace's blocks and
    their tokens. So it binds beyond loopback only with allow_insecure_remote, and not at all with tokens_file:
    tenants must not learn which prompts another tenant's blocks hold (use the Subscribe RPC, per tenant)."""
    if not cfg.kv_events:
        return
    require(not cfg.tokens_file,
            "kv_events with tokens_file: the ZMQ stream carries no token, so every subscriber would see every "
            "tenant's blocks and token ids; turn kv_events off (tenants can tail their own events with `kvstore "
            "events`, the Subscribe RPC) or run without tokens_file")
    for name, endpoint in (("kv_events_endpoint", cfg.kv_events_endpoint),
                           ("kv_events_replay_endpoint", cfg.kv_events_replay_endpoint)):
        host = endpoint_host(endpoint) if endpoint else None
        if host is not None and not is_loopback_host(host):
            require(cfg.allow_insecure_remote,
                    f"{name}={endpoint!r} is reachable from other hosts and the stream has no authentication: "
                    "bind 127.0.0.1 or an ipc:// path, or set allow_insecure_remote = true on a trusted network")
