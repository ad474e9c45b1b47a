"""Configuration (d): two vLLM servers, each with its own kvstore-server, joined by the peer tier through a
real etcd. A turn routed to the other server finds its session's blocks on the first server's daemon and
pulls them over the peer data plane (TCP on loopback here), instead of recomputing them."""

from __future__ import annotations

from typing import Any

from kvstore.testing import EtcdProcess, peer_options

__all__ = ["peer_daemon_options"]


def peer_daemon_options(servers: Any) -> dict[str, object]:
    """DaemonProcess options that join the run's etcd (started on first use, stopped with the servers)."""
    if servers.etcd is None:
        servers.etcd = EtcdProcess().start()
    # replication "owner": a put is pushed to the key's owner, so the other node finds it with one lookup;
    # peer_local_copies: what a node keeps of the blocks it saved but does not own (drop, the daemon's default)
    return peer_options(servers.etcd, ttl_s=5.0, timeout_s=2.0, replication="owner",
                        peer_local_copies=servers.peer_local_copies)
