"""A cluster that changes: four real daemons on a real etcd, each storing its own blocks, then a fifth joins, one
leaves gracefully (SIGTERM) and one is killed (-9). After each event every block that a live node still holds is
found from every live node, with exact bytes, and no call fails; the blocks the dead node alone held are exactly
the ones lost (replication "owner"). Under "owner+1", the killed node's own blocks survive too and two copies
are restored (re-replication from the survivor). And a restart under load: two nodes read every block back to
back while the third leaves and rejoins with the same id, and not one read misses.

Placement is computed here with the same rendezvous hash, so every expectation is exact. The daemons drop the
copies of blocks they do not own once the owner has them (peer_local_copies = "drop", the default): a writer's
after its push, a reader's after its load; the checks assert that too, so one check cannot make the next one
pass by leaving copies behind.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import ExitStack

from kvstore.client import Client
from kvstore.peer.placement import owners
from kvstore.testing import DaemonProcess, peer_options, wait_until
from tests.peer_helpers import Cluster, blocks, needs_etcd, register

pytestmark = [needs_etcd]

NS = "change@d/t"
PER_NODE = 12
SIZE = 64 << 10


def _write_all(cl: Cluster, names: str) -> dict[bytes, tuple[str, bytes]]:
    """Each node puts its own blocks; key -> (writer, value)."""
    out: dict[bytes, tuple[str, bytes]] = {}
    for i, name in enumerate(names):
        keys = [b"%s-blk-%02d" % (name.encode(), j) for j in range(PER_NODE)]
        values = blocks(PER_NODE, SIZE, seed=100 + i)
        cl.clients[name].put_many(NS, keys, values)
        out.update({k: (name, v) for k, v in zip(keys, values)})
    for name in names:
        cl.wait_pushes(name)
    return out


def _holders(cl: Cluster, live: str, keys: list[bytes]) -> dict[bytes, set[str]]:
    """Which live nodes hold each key in their own tiers (local Exists: no peer asked)."""
    held: dict[bytes, set[str]] = {k: set() for k in keys}
    for name in live:
        for k, here in zip(keys, cl.clients[name].exists(NS, keys)):
            if here:
                held[k].add(name)
    return held


def _check_found(cl: Cluster, live: str, data: dict[bytes, tuple[str, bytes]], keys: list[bytes]) -> None:
    """Every key in `keys` is read with exact bytes from every live node (and found by a cluster-wide Exists);
    afterwards a node holds no copy its reads fetched (it dropped them: their owner has them)."""
    for name in live:
        c = cl.clients[name]
        assert c.exists(NS, keys, cluster=True) == [True] * len(keys), name
        here = c.exists(NS, keys)
        got = c.get_many(NS, keys)
        bad = [k for k, g in zip(keys, got) if g != data[k][1]]
        assert not bad, f"{name} read {len(bad)} of {len(keys)} blocks wrong or missing: {bad[:4]}"
        wait_until(lambda: c.exists(NS, keys) == here, 10, 0.05, f"{name} to drop the copies it fetched")


def _wait_handoffs(cl: Cluster, live: str) -> None:
    for name in live:
        c = cl.clients[name]
        wait_until(lambda: c.stats().peers.pending_handoffs == 0, 30, 0.05, f"{name}'s hand-offs")


def _ids(cl: Cluster, names: str) -> list[str]:
    return [cl.nodes[n].node_id for n in names]


def _counter_sum(cl: Cluster, live: str, name: str) -> int:
    return sum(cl.counters(n)[name] for n in live)


def test_join_leave_and_kill_keep_every_block_a_live_node_holds() -> None:
    with ExitStack() as stack:
        cl = Cluster(stack, timeout_s=5.0, names=("a", "b", "c", "d"))
        register(cl.clients, NS)
        data = _write_all(cl, "abcd")
        keys = sorted(data)
        ids4 = _ids(cl, "abcd")
        name_of = {cl.nodes[n].node_id: n for n in "abcd"}
        # each block lives once, at its owner: the writers dropped their copies once the pushes landed
        assert _holders(cl, "abcd", keys) == {k: {name_of[owners(NS, k, ids4, 1)[0]]} for k in keys}
        _check_found(cl, "abcd", data, keys)

        # a fifth node joins: it owns about a fifth of the blocks, which it never received
        before = {n: cl.counters(n) for n in "abcd"}
        cl.join("e")
        register({"e": cl.clients["e"]}, NS)
        cl.wait_members(5)
        # during the hand-off, the old members' reads ask e first, then the previous owner (e's own reads come
        # after: deleting what they fetched could race with a hand-off landing on e)
        _check_found(cl, "abcd", data, keys)
        _wait_handoffs(cl, "abcde")
        ids5 = _ids(cl, "abcde")
        owned_by_e = [k for k in keys if owners(NS, k, ids5, 1)[0] == cl.nodes["e"].node_id]
        assert owned_by_e, "the test needs e to own some blocks"
        assert cl.clients["e"].exists(NS, keys) == [k in owned_by_e for k in keys]  # handed over, nothing else
        handed = sum(cl.counters(n)["handoff_blocks"] - before[n]["handoff_blocks"] for n in "abcd")
        assert handed == len(owned_by_e)
        assert cl.counters("e")["handoff_received"] == len(owned_by_e)
        assert _counter_sum(cl, "abcde", "handoff_refused") == 0
        _check_found(cl, "abcde", data, keys)

        # b leaves gracefully: it hands over what it owns (its own writes included) before it revokes its lease
        assert cl.nodes["b"].stop(signal.SIGTERM) == 0
        assert "leave hand-off:" in cl.nodes["b"].log()
        cl.clients.pop("b").close()
        cl.wait_members(4, on=tuple("acde"), timeout_s=5.0)  # a revoked lease: no TTL to wait out
        _wait_handoffs(cl, "acde")
        _check_found(cl, "acde", data, keys)             # every block: nothing was only on b

        # c is killed: what it owned is lost (one copy each under replication "owner"; its writers dropped theirs),
        # the rest is found
        ids4 = _ids(cl, "acde")
        lost = {k for k in keys if owners(NS, k, ids4, 1)[0] == cl.nodes["c"].node_id}
        cl.nodes["c"].stop(signal.SIGKILL)
        cl.clients.pop("c").close()
        cl.wait_members(3, on=tuple("ade"), timeout_s=15.0)
        _wait_handoffs(cl, "ade")
        held = _holders(cl, "ade", keys)
        assert {k for k, h in held.items() if not h} == lost
        _check_found(cl, "ade", data, [k for k in keys if k not in lost])
        # each surviving block sits at its owner under the three survivors, and only there
        ids3 = _ids(cl, "ade")
        name_of = {cl.nodes[n].node_id: n for n in "ade"}
        assert all(held[k] == {name_of[owners(NS, k, ids3, 1)[0]]} for k in keys if k not in lost)
        assert _counter_sum(cl, "ade", "handoff_refused") == 0


def test_owner_plus_one_keeps_the_killed_nodes_blocks_and_restores_two_copies() -> None:
    with ExitStack() as stack:
        cl = Cluster(stack, timeout_s=5.0, names=("a", "b", "c", "d"), replication="owner+1")
        register(cl.clients, NS)
        data = _write_all(cl, "abcd")
        keys = sorted(data)
        cl.nodes["b"].stop(signal.SIGKILL)
        cl.clients.pop("b").close()
        cl.wait_members(3, on=tuple("acd"), timeout_s=15.0)
        _wait_handoffs(cl, "acd")
        _check_found(cl, "acd", data, keys)              # b's own blocks too: their replica survived
        # two copies again: each block at its owner and its replica among the survivors
        ids3 = _ids(cl, "acd")
        name_of = {cl.nodes[n].node_id: n for n in "acd"}
        held = _holders(cl, "acd", keys)
        for k in keys:
            want = {name_of[m] for m in owners(NS, k, ids3, 2)}
            assert held[k] == want, (k, want, held[k])
        assert _counter_sum(cl, "acd", "handoff_blocks") > 0


def test_a_new_member_is_seen_by_watch_well_before_the_refresh_tick() -> None:
    """peer_refresh_s is 3 s here: a member set read on that tick would see the join seconds later; the watch
    delivers it at once (a bound of 2 s, well under one tick, leaves room for a busy machine)."""
    with ExitStack() as stack:
        cl = Cluster(stack, timeout_s=5.0, names=("a", "b"), ttl_s=10.0, peer_refresh_s=3.0)
        time.sleep(0.5)
        watch_before = cl.counters("a")["member_changes"]
        node = DaemonProcess(**peer_options(cl.etcd, ttl_s=10.0, peer_refresh_s=3.0))
        stack.callback(node.close)
        node.start()
        t0 = time.monotonic()
        a = cl.clients["a"]
        wait_until(lambda: len(a.health().peers.members) == 3, 10, 0.01, "a to see the third member")
        seen_s = time.monotonic() - t0
        assert seen_s < 2.0, f"the join took {seen_s:.2f}s to reach a"
        assert cl.counters("a")["member_changes"] == watch_before + 1
        assert node.stop(signal.SIGTERM) == 0  # a graceful leave: its hand-off, then it revokes its lease
        t1 = time.monotonic()
        wait_until(lambda: len(a.health().peers.members) == 2, 10, 0.01, "a to see the member leave")
        assert time.monotonic() - t1 < 2.0, "a revoked lease reaches the others by watch, not by its TTL (10 s)"
        with Client(cl.nodes["b"].address) as b:
            assert len(b.health().peers.members) == 2


class _Reader:
    """A thread reading every block from one node, over and over, in batches of 8: counts reads, misses, wrong
    blocks and failed calls (with the first few of each), until stopped."""

    def __init__(self, address: str, data: dict[bytes, tuple[str, bytes]]) -> None:
        self.client = Client(address)
        self.data = data
        self.keys = sorted(data)
        self.reads = self.misses = self.wrong = self.errors = 0
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for i in range(0, len(self.keys), 8):
                batch = self.keys[i:i + 8]
                try:
                    got = self.client.get_many(NS, batch)
                except Exception as exc:  # noqa: BLE001 - a failed call is what this counts
                    self.errors += 1
                    self.seen.append(f"error: {exc}")
                    continue
                for k, g in zip(batch, got):
                    self.reads += 1
                    if g is None:
                        self.misses += 1
                        self.seen.append(f"miss {k!r} at {time.monotonic():.3f}")
                    elif g != self.data[k][1]:
                        self.wrong += 1
                        self.seen.append(f"wrong {k!r}")

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(30)
            self.client.close()


def test_reads_under_load_through_a_restart_find_every_block_with_exact_bytes() -> None:
    """b restarts (SIGTERM: its leave hand-off, then a new process with the same node id, empty) while a and c
    read every block back to back: no read fails, none is wrong, none misses: before b leaves it owns its blocks,
    after its leave hand-off their next owners do, after it rejoins the reads ask b and then, until the hand-off
    back to b lands and the cluster settles, the previous owners."""
    with ExitStack() as stack:
        cl = Cluster(stack, timeout_s=5.0, names=("a", "b", "c"))
        register(cl.clients, NS)
        data = _write_all(cl, "abc")
        keys = sorted(data)
        _check_found(cl, "abc", data, keys)
        readers = [_Reader(cl.nodes[n].address, data) for n in "ac"]
        stack.callback(lambda: [r.stop() for r in readers])
        time.sleep(1.0)
        assert cl.nodes["b"].stop(signal.SIGTERM) == 0
        cl.clients.pop("b").close()
        cl.wait_members(2, on=tuple("ac"), timeout_s=5.0)
        time.sleep(1.0)
        cl.join("b")                                      # the same node id: a restart
        register({"b": cl.clients["b"]}, NS)
        cl.wait_members(3)
        _wait_handoffs(cl, "abc")
        wait_until(lambda: all(cl.clients[n].stats().peers.settled for n in "abc"), 30, 0.1,
                   "the cluster to settle")
        time.sleep(1.0)
        for r in readers:
            r.stop()
        for name, r in zip("ac", readers):
            assert r.reads > 3 * len(keys), f"{name} read only {r.reads} blocks"
            assert (r.errors, r.wrong, r.misses) == (0, 0, 0), f"{name}: {r.seen[:6]}"
        ids = _ids(cl, "abc")
        name_of = {cl.nodes[n].node_id: n for n in "abc"}
        assert _holders(cl, "abc", keys) == {k: {name_of[owners(NS, k, ids, 1)[0]]} for k in keys}
        _check_found(cl, "abc", data, keys)
