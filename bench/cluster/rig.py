"""The daemons of one bench.cluster run: a real etcd and N kvstore-servers joined through it, on loopback.

Each node gets capacity_blocks // N RAM slots of one block each (max_block_bytes = the block, watermarks 1.0:
only allocation pressure evicts, as in bench.replay), so N nodes together hold what one node of capacity C
holds. `single()` is that one node, alone (no etcd): the reference the cluster is measured against.

Events (churn.py decides when, and runs them on a thread of their own while the replay goes on): join()
starts one more member; kill() sends SIGKILL (its lease expires after ttl_s); leave() sends SIGTERM (the
daemon hands its blocks over, then revokes its lease); restart() is a leave followed by a start of the same
node id (its RAM starts empty; it is handed the blocks it owns). A node leaves the routing set (`live`) before
its process is touched, under `route_lock`, which the driver holds for each request: a request is never sent
to a node that is being taken away, as a router stops sending to a node it drains. Calls to the live nodes
are what the run's "failed calls" count.
"""

from __future__ import annotations

import signal
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from bench.cluster.drive import register
from kvstore.client import Client
from kvstore.client.reports import PeerTierStats
from kvstore.testing import DaemonProcess, EtcdProcess, peer_options, wait_until

__all__ = ["Rig", "RigConfig", "single"]


@dataclass(frozen=True)
class RigConfig:
    block_bytes: int
    capacity_blocks: int          # C: the whole cluster's RAM, in blocks
    replication: str = "owner"
    ttl_s: float = 2.0
    timeout_s: float = 1.0
    handoff_window_s: float = 120.0
    local_copies: str = "drop"    # peer_local_copies (kvstore/peer/guests.py): drop, guest or keep, for an A/B

    def node_options(self, nodes: int) -> dict[str, Any]:
        per = max(2, self.capacity_blocks // nodes)
        return {"arena_bytes": per * self.block_bytes, "max_block_bytes": self.block_bytes,
                "high_watermark": 1.0, "low_watermark": 1.0, "arena_lock": "off", "log_level": "warning"}


def single(stack: ExitStack, cfg: RigConfig) -> Client:
    """One daemon with the whole capacity C, alone: the reference."""
    d = DaemonProcess(**cfg.node_options(1))
    stack.callback(d.close)
    d.start()
    c = stack.enter_context(d.client(spare_slots=False))
    register(c)
    return c


class Rig:
    def __init__(self, stack: ExitStack, cfg: RigConfig, nodes: int) -> None:
        self._stack = stack
        self.cfg = cfg
        self._nodes_at_start = nodes
        self.etcd = stack.enter_context(EtcdProcess())
        self.daemons: dict[str, DaemonProcess] = {}
        self.clients: dict[str, Client] = {}
        self.route_lock = threading.Lock()  # the driver holds it per request; events take it to change `live`
        self._next = 0
        for _ in range(nodes):
            self._start(self._new())
        self.first_nodes = frozenset(self.clients)
        self.wait_members()
        self.wait_settled()

    @property
    def live(self) -> list[str]:
        return sorted(self.clients)

    def _new(self) -> DaemonProcess:
        name = f"n{self._next}"
        self._next += 1
        opts: dict[str, Any] = {**self.cfg.node_options(self._nodes_at_start),
                                **peer_options(self.etcd, ttl_s=self.cfg.ttl_s, timeout_s=self.cfg.timeout_s,
                                               replication=self.cfg.replication,
                                               peer_handoff_window_s=self.cfg.handoff_window_s,
                                               peer_local_copies=self.cfg.local_copies,
                                               peer_refresh_s=min(0.5, self.cfg.ttl_s / 3))}
        d = DaemonProcess(node_id=name, **opts)
        self._stack.callback(d.close)
        self.daemons[name] = d
        return d

    def _start(self, d: DaemonProcess) -> None:
        d.start()
        c = d.client(spare_slots=False)
        register(c)
        with self.route_lock:
            self.clients[d.node_id] = c

    def _drop(self, name: str) -> None:
        with self.route_lock:
            c = self.clients.pop(name)
        c.close()

    def wait_members(self, timeout_s: float = 30.0) -> None:
        """Every live node sees exactly the live set (a kill is seen once its lease expires)."""
        want = len(self.clients)
        for name, c in list(self.clients.items()):
            wait_until(lambda: len(_peers(c.health().peers).members) == want, timeout_s, 0.05,
                       f"{name} to see {want}")

    def wait_settled(self, timeout_s: float = 60.0) -> None:
        """Every live node reads from owners only: the joins' hand-offs are done and published (the steady state a
        cluster is in between changes; before it, a miss also asks each earlier member set's owners)."""
        for name, c in list(self.clients.items()):
            wait_until(lambda: _peers(c.stats().peers).settled, timeout_s, 0.05, f"{name} to settle")

    def wait_handoffs(self, timeout_s: float = 60.0) -> None:
        for name, c in list(self.clients.items()):
            wait_until(lambda: _peers(c.stats().peers).pending_handoffs == 0, timeout_s, 0.05, f"{name}'s hand-offs")

    # -- events -------------------------------------------------------------------------------------------
    def join(self) -> str:
        d = self._new()
        self._start(d)
        return d.node_id

    def kill(self, name: str) -> None:
        self._drop(name)
        self.daemons[name].stop(signal.SIGKILL)

    def leave(self, name: str) -> None:
        self._drop(name)
        self.daemons[name].stop(signal.SIGTERM, timeout_s=60.0)

    def restart(self, name: str) -> None:
        self.leave(name)
        self._start(self.daemons[name])

    def counters(self) -> dict[str, int]:
        """The peer counters summed over the live nodes."""
        total: dict[str, int] = {}
        for c in list(self.clients.values()):
            for k, v in _peers(c.stats().peers).counters.items():
                total[k] = total.get(k, 0) + v
        return total


def _peers(p: PeerTierStats | None) -> PeerTierStats:
    if p is None:
        raise RuntimeError("a cluster node answered without a peer tier")
    return p
