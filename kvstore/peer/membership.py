"""This node's place in the cluster: its record in etcd under a lease, and the live member set.

One thread does everything on a fixed tick (`refresh_s`): register (grant a lease with `ttl_s`, put the
record), renew the lease, re-read the member records. A member is live while its record exists, i.e. while
its daemon keeps its lease alive; a daemon killed with -9 drops out when its lease expires (at most `ttl_s`).

etcd down: calls fail (counted), this node keeps the last member set it read (peers that are alive keep
working; calls to dead ones time out and are misses) and retries every tick. When etcd answers again, the
keepalive finds the lease gone (it expired meanwhile) and the node registers again (a rejoin, counted).
etcd refusing this node (untrusted certificate, wrong password, no permission: EtcdRefused) is handled the
same way, since the fix may land on etcd's side while the node runs; each distinct failure is logged once
per outage (an error for a refusal), so a wrong password is one clear line, not one a tick, even when
timeouts come in between.
No consensus or gossip of our own: etcd is the only source of membership.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from kvstore.peer.counters import PeerCounters
from kvstore.peer.etcd import EtcdClient, EtcdRefused, EtcdUnavailable

__all__ = ["Member", "Membership"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One node's record in etcd (JSON): how to reach it and how big it is."""

    node_id: str
    control: str        # gRPC host:port
    data: str           # data-plane host:port
    plane: str          # tcp | ucx | grpc: the plane its data address speaks
    capacity_bytes: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes) -> Member | None:
        try:
            d = json.loads(raw)
            return Member(str(d["node_id"]), str(d["control"]), str(d["data"]), str(d["plane"]),
                          int(d["capacity_bytes"]))
        except (ValueError, KeyError, TypeError):
            return None


class Membership:
    def __init__(self, etcd: EtcdClient, prefix: str, me: Member, *, ttl_s: float, refresh_s: float,
                 counters: PeerCounters, on_change: Callable[[dict[str, Member]], None] = lambda m: None) -> None:
        self._etcd = etcd
        self._prefix = prefix.encode()
        self.me = me
        self._ttl = max(1, round(ttl_s))  # etcd leases have whole seconds
        self._refresh = refresh_s
        self._counters = counters
        self._on_change = on_change
        self._lease = 0
        self._members: dict[str, Member] = {me.node_id: me}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.connected = False
        self._logged: set[str] = set()  # failures logged during this outage (cleared when etcd answers)
        self._thread = threading.Thread(target=self._loop, name="kvstore-membership", daemon=True)

    # -- reads (any thread) ------------------------------------------------------------------------------
    def members(self) -> dict[str, Member]:
        """The live member set, this node included (a copy)."""
        with self._lock:
            return dict(self._members)

    # -- life cycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._tick()  # join before serving peers when etcd is up; a down etcd only logs and retries
        self._thread.start()

    def stop(self) -> None:
        """Leave at once (revoke the lease) so peers stop routing here without waiting for the TTL."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._lease:
            try:
                self._etcd.revoke(self._lease)
            except EtcdUnavailable:
                pass  # the lease expires by itself

    def _loop(self) -> None:
        while not self._stop.wait(self._refresh):
            try:
                self._tick()
            except Exception:  # membership must outlive a bug in one tick; the log says what happened
                log.exception("membership tick failed")

    def _tick(self) -> None:
        try:
            self._keep_registered()
            records = self._etcd.range_prefix(self._prefix)
        except EtcdUnavailable as exc:
            self._counters.add("etcd_errors")
            if str(exc) not in self._logged and len(self._logged) < 64:
                self._logged.add(str(exc))
                if isinstance(exc, EtcdRefused):
                    log.error("etcd refused this node, serving with the last member set (%d members): %s",
                              len(self._members), exc)
                else:
                    log.warning("etcd unreachable, serving with the last member set (%d members): %s",
                                len(self._members), exc)
            self.connected = False
            return
        if not self.connected:
            log.info("etcd reachable: registered as %s", self.me.node_id)
        self.connected = True
        self._logged.clear()
        found = {self.me.node_id: self.me}
        for _, raw in records:
            m = Member.decode(raw)
            if m is None:
                log.warning("ignoring an unreadable member record under %s", self._prefix.decode())
            elif m.node_id != self.me.node_id:
                found[m.node_id] = m
        with self._lock:
            changed = found != self._members
            self._members = found
        if changed:
            log.info("member set: %s", ", ".join(sorted(found)))
            self._on_change(found)

    def _keep_registered(self) -> None:
        if self._lease and self._etcd.keepalive(self._lease) > 0:
            return
        if self._lease:
            log.warning("etcd lease %x expired (etcd was unreachable longer than %ss): registering again",
                        self._lease, self._ttl)
        self._lease = self._etcd.grant(self._ttl)
        self._etcd.put(self._prefix + self.me.node_id.encode(), self.me.encode(), self._lease)
        self._counters.add("rejoins")
