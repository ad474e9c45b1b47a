"""The daemon's sockets and state directories: checked before anything is created, bound as late as possible.

    check_state_dirs   the socket's and the disk tier's directories: not writable by, nor owned by, another user
    prepare_socket_dir the socket's directory (0700), a stale socket a dead daemon left removed
    check_port_free    nobody listens on the TCP address (gRPC binds with SO_REUSEPORT, for a successor)
    unlink_quietly     remove a path that may be gone already
    warn_exposure      say at every start which listener other hosts can reach, and with what
"""

from __future__ import annotations

import logging
import os
import socket

from kvstore.errors import ConfigError
from kvstore.fastpath.sockets import clear_stale_socket
from kvstore.security import check_not_world_writable_dir, is_loopback_address
from kvstore.server.config import ServerConfig
from kvstore.server.config.security import unused_peer_settings

__all__ = ["check_state_dirs", "prepare_socket_dir", "check_port_free", "unlink_quietly", "warn_exposure"]

log = logging.getLogger("kvstore.server")


def check_state_dirs(cfg: ServerConfig) -> None:
    """The socket's directory and the disk tier's directory must not be writable by other users, nor belong to
    one. (A world-writable parent such as a tmpfs mount point is fine: the sticky bit keeps our directory ours,
    and an existing one owned by someone else is refused.)"""
    if cfg.unix_socket:
        check_not_world_writable_dir(os.path.dirname(cfg.unix_socket) or ".", "unix_socket directory")
    if cfg.disk_bytes:
        check_not_world_writable_dir(cfg.disk_dir, "disk_dir")


def prepare_socket_dir(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    clear_stale_socket(path, "unix socket")


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_port_free(listen: str) -> None:
    """ConfigError when another process listens on `listen` (gRPC binds with SO_REUSEPORT so that a successor
    can bind beside this daemon: without this check a second daemon would silently share the port)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return  # gRPC's own bind reports what is wrong with the address
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {listen}: {exc.strerror} (another kvstore-server? stop it, or start "
                              "this one with --take-over to take its place)") from exc


def warn_exposure(cfg: ServerConfig, tokens: bool) -> None:
    """A warning at every start for each listener reachable from other hosts."""
    exposed = [a for a in (cfg.listen, cfg.peer_listen if cfg.peer_endpoints else "") if a
               and not is_loopback_address(a)]
    if exposed and not cfg.tls.enabled:
        log.warning("SECURITY: allow_insecure_remote is set and %s %s reachable from other hosts WITHOUT TLS: "
                    "anyone on the network can read and write every block%s", ", ".join(exposed),
                    "is" if len(exposed) == 1 else "are",
                    "" if tokens else " (and there are no tokens)")
    unused = unused_peer_settings(cfg)
    if unused:
        log.info("peer tier off (etcd_endpoints is empty): %s not used; set etcd_endpoints to join a cluster",
                 ", ".join(unused))
    if cfg.metrics_listen and not is_loopback_address(cfg.metrics_listen):
        shown = "up to 50 namespace names" if cfg.metrics_labels == "name" else f"{cfg.metrics_labels} labels, no names"
        log.warning("metrics_listen=%s is reachable from other hosts over plain HTTP (counters and %s; no keys or "
                    "bytes)", cfg.metrics_listen, shown)
