"""Shared pieces of the peer-tier tests: a real etcd and three real daemons that join it."""

from __future__ import annotations

import os
from contextlib import ExitStack


from kvstore.peer.placement import rank
from kvstore.testing import DaemonProcess, EtcdProcess, etcd_binary, peer_options, wait_until
from tests.required import needs

# skipped when missing, failed under KVSTORE_REQUIRE_ALL=1 (CI): see tests/required.py
needs_etcd = needs(etcd_binary() is not None, "etcd (the etcd server binary)",
                   "apt-get install -y etcd-server (make setup does)")


def ucx_available() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


needs_ucx = needs(ucx_available(), "ucxx (the ucx data plane)", "pip install -e '.[ucx]' (make setup does)")


class Cluster:
    """etcd + daemons a, b, c (node ids given), each with its own ports, arena and data port."""

    def __init__(self, stack: ExitStack, plane: str = "tcp", ttl_s: float = 2.0, timeout_s: float = 1.0,
                 names: tuple[str, ...] = ("a", "b", "c"), **opts: object) -> None:
        self.etcd = stack.enter_context(EtcdProcess())
        self.stack = stack
        self.options = dict(plane=plane, ttl_s=ttl_s, timeout_s=timeout_s, **opts)  # a joining node's (join())
        self.tag = tag = os.urandom(3).hex()
        self.ids = [f"{n}-{tag}" for n in names]
        self.nodes: dict[str, DaemonProcess] = {}
        for name, node_id in zip(names, self.ids):
            d = DaemonProcess(node_id=node_id, **peer_options(self.etcd, plane=plane, ttl_s=ttl_s,
                                                               timeout_s=timeout_s, **opts))
            stack.callback(d.close)
            stack.callback(_report_if_dead, name, d)  # runs before close: the log is still there
            self.nodes[name] = d.start()
        self.clients = {n: stack.enter_context(d.client()) for n, d in self.nodes.items()}
        self.wait_members(len(names))

    def join(self, name: str) -> DaemonProcess:
        """Start one more daemon with the same options; it joins the cluster (its client is in `clients`)."""
        node = DaemonProcess(node_id=f"{name}-{self.tag}", **peer_options(self.etcd, **self.options))
        self.stack.callback(node.close)
        self.stack.callback(_report_if_dead, name, node)
        self.nodes[name] = node.start()
        self.clients[name] = self.stack.enter_context(node.client())
        self.ids.append(node.node_id)
        return node

    def wait_members(self, n: int, on: tuple[str, ...] | None = None, timeout_s: float = 15.0) -> None:
        for name in on or tuple(self.clients):
            c = self.clients[name]
            wait_until(lambda: len(c.health().peers.members) == n, timeout_s, 0.05, f"{name} to see {n} members")

    def owner(self, ns: str, key: bytes, alive: tuple[str, ...] | None = None) -> str:
        """The node name (a, b, c) that owns a block."""
        names = alive or tuple(self.nodes)
        ids = [self.nodes[n].node_id for n in names]
        return names[ids.index(rank(ns, key, ids)[0])]

    def counters(self, name: str) -> dict[str, int]:
        return self.clients[name].stats().peers.counters

    def wait_pushes(self, name: str) -> None:
        c = self.clients[name]
        wait_until(lambda: c.stats().peers.pending_pushes == 0, 10, 0.02, f"{name}'s pushes")


def _report_if_dead(name: str, d: DaemonProcess) -> None:
    """A node that died on its own (not killed by the test) leaves its log tail in the test's output."""
    code = d.proc.poll() if d.proc is not None else None
    if code is not None and code != -9:
        print(f"--- node {name} ({d.node_id}) exited with {code}; log tail:\n{d.log()[-6000:]}")


def register(clients: dict, ns: str) -> None:
    for c in clients.values():
        c.register_namespace(ns, model="m", layout_digest="d", tenant="t")


def blocks(n: int, size: int, seed: int) -> list[bytes]:
    import random
    rnd = random.Random(seed)
    return [rnd.randbytes(size) for _ in range(n)]
