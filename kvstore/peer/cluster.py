"""The peer tier as one object the composition root builds: membership, placement, data plane, reads, pushes,
hand-off.

    PeerCluster(PeerConfig, engine, arena view, transfer meter)
      start()     data-plane listener, then join etcd and watch the member set (a down etcd is retried; the node
                  serves alone meanwhile), then the pusher and the hand-off thread; the engine gets this object
                  as its `remote` hooks
      fill()      engine hook on a leased Lookup: fetch local misses from their owners (remote_tier.RemoteTier),
                  then from their previous owners during a hand-off window
      prefetch()  engine hook on a Lookup without lease: probe owners, fetch in the background
      held_elsewhere()  engine hook of a cluster-wide Exists: which keys their owners hold (metadata only)
      committed() engine hook on Commit: queue pushes to owners (replicator.Replicator)
      status()    members, etcd state, counters, pushes and hand-offs pending (Stats, Health, metrics)
      leave()     SIGTERM: hand this node's blocks to their next owners (bounded by leave_timeout_s), then stop()
      stop()      leave etcd (revoke the lease), stop pushing and handing off, close the listener; stop(revoke=
                  False) for a hand-over restart: the successor keeps the lease and record (no member change)

Every member-set change the watch reports becomes a change.MemberChange (before -> after): the view keeps
the earlier sets for `handoff_window_s` (the intake accepts blocks it owned), the hand-off thread moves the
blocks this node holds for new owners (handoff.py) and, once it has moved all of them, publishes that in this
node's settle marker in etcd. Reads ask previous owners until every member's marker names the current set
(settled(); change.py, membership.py), or the window ends.

Without `etcd_endpoints` the daemon never builds one, and nothing of this runs.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.addresses import is_wildcard, parse_host_port
from kvstore.engine.results import Filled
from kvstore.errors import ConfigError
from kvstore.peer.change import MemberView
from kvstore.peer.counters import PeerCounters
from kvstore.peer.etcd import EtcdClient
from kvstore.peer.guests import LOCAL_COPIES, Guests
from kvstore.peer.handoff import HandOff, PassReport
from kvstore.peer.intake import HandOffIntake
from kvstore.peer.local import LocalStore
from kvstore.peer.membership import Member, Membership
from kvstore.peer.placement import read_orders
from kvstore.peer.plane import DataPlane
from kvstore.peer.remote_tier import RemoteTier
from kvstore.peer.replicator import Replicator
from kvstore.peer.scores import NodeShare, shares
from kvstore.security.etcd import EtcdSecurity
from kvstore.security.tls import TlsFiles
from kvstore.transfers import TransferMeter

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

__all__ = ["PeerConfig", "PeerCluster", "PeerStatus", "COPIES", "PLANES"]

log = logging.getLogger(__name__)

COPIES = {"off": 0, "owner": 1, "owner+1": 2}   # peer_replication -> copies pushed after a put
PLANES = ("tcp", "ucx", "grpc")                   # peer_data_plane names make_plane knows
_ETCD_URL = re.compile(r"https?://[^/\s]+(:\d+)?/?")


@dataclass(frozen=True)
class PeerConfig:
    """The peer tier's part of the daemon config; a bad value raises ConfigError at construction.

    ServerConfig (kvstore/server/config/) builds it, even without etcd_endpoints (inert then, but a typo should
    not wait for the day the node joins a cluster to surface); the rules below are the only place the peer
    settings are checked, and each message names the daemon setting (peer_*, etcd_*) a user would change.
    Rules that tie the peer tier to TLS, tokens and etcd security live in server/config/security.py.
    """

    node_id: str
    etcd_endpoints: tuple[str, ...]
    etcd_prefix: str
    listen: str
    advertise: str
    control_address: str
    lease_ttl_s: float
    refresh_s: float
    replication: str
    data_plane: str
    timeout_s: float
    push_queue_blocks: int
    max_keys: int
    max_block_bytes: int
    capacity_bytes: int
    tls: TlsFiles | None = None  # mutual TLS on the tcp data plane (server/config refuses other planes with TLS)
    # a data-plane connection that carries no frame for this long is closed (tcp and ucx listeners)
    idle_timeout_s: float = 60.0
    etcd_security: EtcdSecurity | None = None  # etcd's CA, client certificate and user (security/etcd.py)
    handoff_bytes_per_s: int = 1 << 30          # hand-off sending rate (handoff.py)
    handoff_intake_bytes_per_s: int = 4 << 30   # hand-off intake budget (intake.py)
    handoff_window_s: float = 120.0             # reads ask previous owners this long after a change (change.py)
    leave_timeout_s: float = 20.0               # SIGTERM: hand-off before leaving, at most this long
    local_copies: str = "drop"                  # copies this node does not own: dropped (guests.py)

    def __post_init__(self) -> None:
        for url in self.etcd_endpoints:
            _require(_ETCD_URL.fullmatch(url) is not None,
                     f"etcd_endpoints: {url!r} is not an etcd client URL; use e.g. https://10.0.0.5:2379")
            _require("@" not in url, f"etcd_endpoints: {url!r} carries credentials; take them out of the URL "
                     "and use etcd_user and etcd_password_file")
        _require(not self.etcd_endpoints or (self.node_id != "" and self.node_id.encode()[0] < ord("~")),
                 f"node_id={self.node_id!r}: a cluster member's id must start with a character below '~' (a letter "
                 "or digit, as hostnames do): etcd keys from '~' on under etcd_prefix hold settle markers")
        _require(self.etcd_prefix.startswith("/") and self.etcd_prefix.endswith("/"),
                 f"etcd_prefix={self.etcd_prefix!r}: use a path that starts and ends with '/', e.g. /kvstore/members/")
        self._check_addresses()
        _require(0.5 <= self.lease_ttl_s <= 300,
                 f"peer_lease_ttl_s={self.lease_ttl_s}: use 0.5..300 seconds (short: a dead node leaves sooner)")
        _require(0.05 <= self.refresh_s <= self.lease_ttl_s / 3,
                 f"peer_refresh_s={self.refresh_s}: use 0.05..peer_lease_ttl_s/3 ({self.lease_ttl_s / 3:g}) "
                 "so the lease is renewed at least three times per TTL")
        _require(self.replication in COPIES,
                 f"peer_replication={self.replication!r}: use {_one_of(tuple(COPIES))}")
        _require(self.data_plane in PLANES, f"peer_data_plane={self.data_plane!r}: use {_one_of(PLANES)}")
        _require(0.01 <= self.timeout_s <= 60, f"peer_timeout_s={self.timeout_s}: use 0.01..60 seconds")
        _require(1 <= self.idle_timeout_s <= 3600,
                 f"peer_idle_timeout_s={self.idle_timeout_s}: use 1..3600 seconds")
        _require(1 <= self.push_queue_blocks <= 1 << 20,
                 f"peer_push_queue_blocks={self.push_queue_blocks}: use 1..1048576")
        for name, rate in (("peer_handoff_bytes_per_s", self.handoff_bytes_per_s),
                           ("peer_handoff_intake_bytes_per_s", self.handoff_intake_bytes_per_s)):
            _require(1 << 20 <= rate <= 1 << 40,
                     f"{name}={rate}: use 1MiB..1TiB per second (a hand-off slower than 1 MiB/s never finishes)")
        _require(0 <= self.handoff_window_s <= 86400,
                 f"peer_handoff_window_s={self.handoff_window_s}: use 0..86400 seconds (0: never ask previous owners)")
        _require(self.local_copies in LOCAL_COPIES,
                 f"peer_local_copies={self.local_copies!r}: use {_one_of(LOCAL_COPIES)}")
        _require(0 <= self.leave_timeout_s <= 3600,
                 f"peer_leave_timeout_s={self.leave_timeout_s}: use 0..3600 seconds (keep it below the pod's "
                 "terminationGracePeriodSeconds)")

    def _check_addresses(self) -> None:
        """Every address is host:port (an IP or a host name, never the literal `$(HOST_IP)` of a pod variable
        the pod lacks); peer_listen may bind port 0 (the kernel picks one; the member record carries it). With
        the peer tier on, the data address peers are told (peer_advertise, else peer_listen) names one host, and
        a gRPC address is needed only by the grpc data plane, which calls it (with the tcp and ucx planes it is
        informational: `kvstore inspect` asks members there; with listen = '' a member has none)."""
        for name, value, lowest in (("peer_listen", self.listen, 0), ("peer_advertise", self.advertise, 1),
                                    ("peer_control_advertise", self.control_address, 1)):
            if value or name == "peer_listen":
                try:
                    parse_host_port(value, lowest_port=lowest)
                except ValueError as exc:
                    _require(False, f"{name}={value!r}: {exc}; use host:port with this node's address, e.g. "
                             "10.0.0.7:7071 (Kubernetes: $(HOST_IP):7071 from the downward API)")
        if not self.etcd_endpoints:
            return
        if not self.advertise:
            _require(not is_wildcard(parse_host_port(self.listen, lowest_port=0).host),
                     f"peer_listen={self.listen!r} listens on every interface, so it is no address peers can dial: "
                     "set peer_advertise to this node's host:port (Kubernetes: KVSTORE_PEER_ADVERTISE="
                     "$(HOST_IP):7071), or listen on that address")
        else:
            _require(not is_wildcard(parse_host_port(self.advertise).host),
                     f"peer_advertise={self.advertise!r} names no host peers can dial: use this node's address")
        _require(bool(self.control_address) or self.data_plane != "grpc",
                 "peer_data_plane = 'grpc' calls peers on their gRPC port, but listen is empty: set listen (or "
                 "peer_control_advertise) to this node's host:port, or use the tcp data plane")


def _one_of(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError("invalid config: " + message)


@dataclass(frozen=True)
class PeerStatus:
    node_id: str
    etcd_connected: bool
    data_plane: str
    data_address: str
    replication: str
    members: tuple[Member, ...]
    counters: dict[str, int]
    pending_pushes: int
    pending_handoffs: int = 0
    settled: bool = False   # no earlier member set to ask (PeerCluster.settled)


def make_plane(cfg: PeerConfig, local: LocalStore, counters: PeerCounters, meter: TransferMeter) -> DataPlane:
    timeout_s, max_keys, max_block_bytes = cfg.timeout_s, cfg.max_keys, cfg.max_block_bytes
    if cfg.data_plane == "tcp":
        from kvstore.peer.tcp_plane import TcpPlane
        return TcpPlane(local, counters, meter, listen=cfg.listen, advertise=cfg.advertise, tls=cfg.tls,
                        idle_timeout_s=cfg.idle_timeout_s, timeout_s=timeout_s, max_keys=max_keys,
                        max_block_bytes=max_block_bytes)
    if cfg.data_plane == "ucx":
        from kvstore.peer.ucx_plane import UcxPlane  # imports ucxx: only when asked for
        return UcxPlane(local, counters, meter, listen=cfg.listen, advertise=cfg.advertise,
                        idle_timeout_s=cfg.idle_timeout_s, timeout_s=timeout_s, max_keys=max_keys,
                        max_block_bytes=max_block_bytes)
    if cfg.data_plane == "grpc":
        from kvstore.peer.grpc_plane import GrpcPlane
        return GrpcPlane(local, counters, meter, control_address=cfg.control_address, timeout_s=timeout_s,
                         max_keys=max_keys, max_block_bytes=max_block_bytes)
    # PeerConfig refuses other names; a PeerConfig built around that check must not get a silent gRPC plane
    raise ConfigError(f"peer_data_plane={cfg.data_plane!r}: one of {', '.join(PLANES)}")


class PeerCluster:
    def __init__(self, cfg: PeerConfig, engine: Engine, view: np.ndarray, meter: TransferMeter) -> None:
        self.cfg = cfg
        self.counters = PeerCounters()
        self.local = LocalStore(engine, view, self.counters)
        self.plane = make_plane(cfg, self.local, self.counters, meter)
        self._engine = engine
        self.membership: Membership | None = None
        self._all_placed = True  # no member is leaving (one that is still holds blocks it is handing over)
        copies = COPIES[cfg.replication]
        self.view = MemberView(cfg.node_id, copies, cfg.handoff_window_s)
        guests = Guests(self.local, self.view, self.counters, cfg.local_copies if copies else "keep")
        self.remote = RemoteTier(engine, self.plane, self._members, cfg.node_id, copies=copies,
                                 timeout_s=cfg.timeout_s, max_keys=cfg.max_keys, counters=self.counters,
                                 backoff_s=min(1.0, cfg.lease_ttl_s / 2), previous=self.read_previous,
                                 fetched=guests.read, placement=self.view.current)
        self.replicator = Replicator(self.local, self.plane, self._members, cfg.node_id, copies=copies,
                                     queue_blocks=cfg.push_queue_blocks, counters=self.counters,
                                     landed=guests.sent, placement=self.view.current)
        self.handoff = HandOff(self.local, self.plane, self._members, cfg.node_id, copies=copies,
                               bytes_per_s=cfg.handoff_bytes_per_s, counters=self.counters,
                               batch_keys=min(32, cfg.max_keys), landed=guests.sent, settled=self._settled,
                               settle_grace_s=cfg.timeout_s + 1.0)
        self.local.set_handoff_gate(HandOffIntake(self.view, self.counters, cfg.handoff_intake_bytes_per_s))

    def _members(self) -> dict[str, Member]:
        if self.membership is None:
            return {}
        return self.membership.members()

    def start(self, lease: int = 0) -> None:
        """`lease`: a predecessor's etcd lease (a hand-over restart keeps this node's membership: see
        Membership.keep_lease): peers see no change, so nothing is handed off."""
        cfg = self.cfg
        self.plane.start()
        me = Member(cfg.node_id, cfg.control_address, self.plane.address, cfg.data_plane, cfg.capacity_bytes)
        etcd = EtcdClient(cfg.etcd_endpoints, timeout_s=min(1.0, cfg.lease_ttl_s / 3), security=cfg.etcd_security)
        self.membership = Membership(etcd, cfg.etcd_prefix, me, ttl_s=cfg.lease_ttl_s, refresh_s=cfg.refresh_s,
                                     counters=self.counters, on_change=self._changed)
        if lease:
            self.membership.keep_lease(lease)
        self.replicator.start()
        self.handoff.start()
        self.membership.start()
        self._engine.attach_remote(self)
        log.info("peer tier: node=%s plane=%s data=%s replication=%s etcd=%s", cfg.node_id, cfg.data_plane,
                 self.plane.address, cfg.replication, ",".join(cfg.etcd_endpoints))

    def _changed(self, members: dict[str, Member]) -> None:
        """The watch saw a new member set: record the change, hand off what moved (in the background)."""
        self._check_planes(members)
        change = self.view.apply(m for m, rec in members.items() if not rec.leaving)
        self._all_placed = not any(rec.leaving for rec in members.values())
        if change is not None:  # this node's own join too: blocks it recovered from disk may belong elsewhere
            log.info("member change %s: %d members", change.describe(), len(change.after))
            if self.membership is not None:
                _, digest, epoch = self.view.state()
                try:
                    self.membership.unsettle(also=digest)
                except Exception:  # a bug here must not cost the change its hand-off
                    log.exception("could not take this node's settle marker back")
                self.membership.await_settled(digest, len(change.after), epoch,
                                              time.monotonic() + self.cfg.handoff_window_s)
            self.handoff.schedule(change)

    def _settled(self, after: frozenset[str]) -> None:
        """The hand-off thread has moved everything for `after`: say so in etcd, if `after` is still current."""
        current, digest, _ = self.view.state()
        if self.membership is not None and after == current:
            self.membership.publish_settled(digest)

    def _counted(self) -> bool:
        """Every member (none leaving) has handed off everything for the current set (its settle marker is in
        etcd: membership.py), counted for this very change (epoch): a set seen again later is settled again."""
        return self.membership is not None and self._all_placed \
            and self.membership.settled_token == self.view.state()[2]

    def settled(self) -> bool:
        """No earlier member set to ask: counted settled, or the window holds none, so no earlier owner holds a
        block the current owners lack."""
        return self._counted() or not self.view.previous()

    def read_previous(self) -> list[frozenset[str]]:
        """The earlier member sets reads ask (newest first): those of the hand-off window until settled()."""
        return [] if self._counted() else self.view.previous()

    def _check_planes(self, members: dict[str, Member]) -> None:
        for m in members.values():
            if m.plane != self.cfg.data_plane:
                log.warning("member %s speaks data plane %s, this node %s: calls to it will fail (use one plane "
                            "per cluster)", m.node_id, m.plane, self.cfg.data_plane)

    def leave(self) -> PassReport | None:
        """A graceful leave (SIGTERM): hand every block this node owns to the member that owns it next, within
        leave_timeout_s, while still a member (peers keep reading from it meanwhile), then stop(). None when
        there is nobody to hand to (alone, replication off, leave_timeout_s 0)."""
        report = None
        members = self.view.current()
        if self.cfg.leave_timeout_s > 0 and len(members) > 1 and self.membership is not None:
            # out of placement first (peers stop pushing here and read what it owned from it until it lands at
            # its next owners), then what is queued, then the hand-off; pushes already on the wire land during
            # a grace of one call's bound, and the hand-off runs again over what arrived meanwhile
            self.membership.mark_leaving()
            self.replicator.flush(self.cfg.leave_timeout_s / 4)
            report = self.handoff.leave(members, self.cfg.leave_timeout_s, grace_s=min(1.0, self.cfg.timeout_s))
        self.stop()
        return report

    def stop(self, revoke: bool = True) -> None:
        """`revoke` False: a hand-over; the etcd lease and record stay for the successor (no leave, no hand-off:
        the blocks stay in this node's RAM, which the successor serves)."""
        self._engine.attach_remote(None)
        self.handoff.stop()
        self.replicator.stop()
        if self.membership is not None:
            self.membership.stop(revoke=revoke)
        self.remote.close()
        self.plane.stop()

    # -- engine hooks ---------------------------------------------------------------------------------------
    def fill(self, namespace: str, keys: Sequence[bytes]) -> Filled:
        return self.remote.fill(namespace, list(keys))

    def prefetch(self, namespace: str, keys: Sequence[bytes], prefix: bool = False) -> list[bool]:
        return self.remote.prefetch(namespace, list(keys), prefix)

    def committed(self, reservation_id: int, namespace: str, keys: Sequence[bytes]) -> None:
        self.replicator.committed(reservation_id, namespace, keys)

    def loaded(self, namespace: str, keys: Sequence[bytes]) -> None:
        self.remote.loaded(namespace, list(keys))

    def claim(self, namespace: str, keys: Sequence[bytes], claimant: bytes, ttl_ms: int) -> dict[bytes, int]:
        return self.remote.claim(namespace, list(keys), claimant, ttl_ms)

    def held_elsewhere(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key: a peer holds it (its owner, or a previous owner during a hand-off window); metadata only."""
        if len(self._members()) < 2 or not keys:
            return [False] * len(keys)
        found = self.remote.locate(namespace, list(keys))
        self.counters.add("exists_remote_calls")
        held = {k for _, ks in found for k in ks}
        self.counters.add("exists_remote_hits", len(held))
        return [k in held for k in keys]

    def prefix_shares(self, namespace: str, keys: list[bytes]) -> list[NodeShare]:
        """Every live member's share of the chain `keys` (scores.py): one tiers probe per peer, pipelined where
        the plane can, and this node's own tiers; metadata only."""
        members = self._members()
        me = self.cfg.node_id
        own = self._engine.tiers(namespace, keys)  # refuses bad keys / an unknown namespace before any peer call
        peers = [m for node, m in sorted(members.items()) if node != me]
        tiers: dict[str, list[int] | None] = {me: own}
        answers = self.plane.probe_tiers_many([(m, namespace, keys) for m in peers]) if peers and keys else []
        for m, a in zip(peers, answers):
            tiers[m.node_id] = a if isinstance(a, list) else None
            if not isinstance(a, list):
                log.warning("prefix score: %s did not answer (%s); its tiers count as empty", m.node_id, a)
        for m in peers[len(answers):]:
            tiers[m.node_id] = [0] * len(keys)
        self.counters.add("score_calls")
        owning, previous, reachable = self.view.current(), self.read_previous(), frozenset(members) | {me}
        copies = COPIES[self.cfg.replication]
        return shares(len(keys), tiers, {n: m.control for n, m in members.items()}, me,
                      lambda node: read_orders(namespace, keys, owning, previous, copies, node, reachable))

    # -- inspection -----------------------------------------------------------------------------------------
    def status(self) -> PeerStatus:
        members = self._members()
        return PeerStatus(self.cfg.node_id, bool(self.membership and self.membership.connected), self.cfg.data_plane,
                          self.plane.address, self.cfg.replication,
                          tuple(members[k] for k in sorted(members)), self.counters.snapshot(),
                          self.replicator.pending, self.handoff.pending, self.settled())
