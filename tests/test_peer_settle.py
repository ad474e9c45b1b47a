"""Settling, on real daemons and a real etcd: after a join, reads ask previous owners only until every member has
handed off for the new set and said so in its etcd record; from then on a miss costs one probe per owner and no
fallback, long before the hand-off window (120 s here) ends. A node settling is not a member change, and a
node that dies unsettles the cluster until its lease expires and the survivors have handed off again. Every
block stays readable, bytes exact, throughout.

The units (record field, the hand-off thread's grace and catch-up): tests/test_peer_settle_units.py.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack

from kvstore.peer.change import set_digest
from kvstore.peer.counters import PeerCounters
from kvstore.peer.etcd import EtcdClient
from kvstore.peer.membership import Member, Membership
from kvstore.peer.placement import owners
from kvstore.testing import EtcdProcess, wait_until
from tests.peer_helpers import Cluster, blocks, needs_etcd, register

pytestmark = [needs_etcd]

NS = "settle@d/t"


def _settled(cl: Cluster, names: str) -> list[bool]:
    return [cl.clients[n].stats().peers.settled for n in names]


def _wait_settled(cl: Cluster, names: str) -> None:
    for n in names:
        c = cl.clients[n]
        wait_until(lambda: c.stats().peers.settled, 30, 0.05, f"{n} to settle")


def _check_all(cl: Cluster, names: str, data: dict[bytes, bytes]) -> None:
    keys = sorted(data)
    for n in names:
        got = cl.clients[n].get_many(NS, keys)
        assert [g == data[k] for k, g in zip(keys, got)] == [True] * len(keys), n


def test_reads_stop_asking_previous_owners_once_every_member_has_settled() -> None:
    with ExitStack() as stack:
        # grace = peer_timeout_s + 1 = 6 s: a node cannot settle before the checks right after the join
        cl = Cluster(stack, timeout_s=5.0, names=("a", "b"), peer_handoff_window_s=120)
        register(cl.clients, NS)
        _wait_settled(cl, "ab")
        data: dict[bytes, bytes] = {}
        for i, n in enumerate("ab"):
            keys = [b"%s-settle-%02d" % (n.encode(), j) for j in range(16)]
            values = blocks(16, 48 << 10, seed=40 + i)
            cl.clients[n].put_many(NS, keys, values)
            data.update(zip(keys, values))
        for n in "ab":
            cl.wait_pushes(n)
        changes_before = cl.counters("a")["member_changes"]

        cl.join("c")
        register({"c": cl.clients["c"]}, NS)
        cl.wait_members(3)
        # c has no marker yet, and a and b are inside their grace: nobody is settled, reads fall back
        assert _settled(cl, "abc") == [False, False, False]
        _check_all(cl, "abc", data)

        _wait_settled(cl, "abc")
        assert cl.clients["a"].stats().peers.pending_handoffs == 0
        assert sum(cl.counters(n)["handoff_settles"] for n in "abc") >= 3
        # three nodes published settle markers: still one member change (the join) at a
        assert cl.counters("a")["member_changes"] == changes_before + 1
        ids = [cl.nodes[n].node_id for n in "abc"]
        owned_by_c = [k for k in data if owners(NS, k, ids, 1)[0] == cl.nodes["c"].node_id]
        assert owned_by_c and cl.clients["c"].exists(NS, owned_by_c) == [True] * len(owned_by_c)

        # settled: a miss asks each key's owner once and no previous owner (within the 120 s window)
        fresh = [os.urandom(16) for _ in range(48)]
        before = cl.counters("a")
        assert cl.clients["a"].exists(NS, fresh, cluster=True) == [False] * 48
        after = cl.counters("a")
        assert after["fallback_keys"] - before["fallback_keys"] == 0
        asked = {owners(NS, k, ids, 1)[0] for k in fresh} - {cl.nodes["a"].node_id}
        assert after["probe_calls"] - before["probe_calls"] == len(asked)
        _check_all(cl, "abc", data)

        # c dies: its record (settled) stays until its lease expires; then the survivors hand off and settle again
        lost = set(owned_by_c)
        cl.nodes["c"].stop(signal.SIGKILL)
        cl.clients.pop("c").close()
        cl.wait_members(2, on=("a", "b"), timeout_s=15)
        _wait_settled(cl, "ab")
        assert cl.counters("a")["member_changes"] == changes_before + 2
        _check_all(cl, "ab", {k: v for k, v in data.items() if k not in lost})


def test_settle_markers_are_counted_outside_the_member_range() -> None:
    """Membership's markers against a real etcd: published under the lease, counted by await_settled on the
    keepalive tick, deleted by unsettle and by the lease's end; the member watch and reads never see them."""
    with EtcdProcess() as e:
        counters = {n: PeerCounters() for n in "ab"}

        def member(name: str) -> Membership:
            return Membership(EtcdClient([e.endpoint], timeout_s=1.0), "/s/", Member(name, "", "", "tcp", 0),
                              ttl_s=3.0, refresh_s=0.1, counters=counters[name])

        a, b = member("a"), member("b")
        a.start()
        b.start()
        etcd = EtcdClient([e.endpoint], timeout_s=1.0)
        try:
            wait_until(lambda: set(a.members()) == {"a", "b"} == set(b.members()), 5, 0.01, "a and b to meet")
            changes = counters["a"].get("member_changes")
            d = set_digest(["a", "b"])
            a.await_settled(d, 2, 7, time.monotonic() + 60)
            assert a.publish_settled(d)
            assert etcd.count_prefix(b"/s/~settled/" + d.encode() + b"/") == 1
            time.sleep(0.5)                               # five ticks: one marker of two is not settled
            assert a.settled_token == -1
            assert b.publish_settled(d)
            wait_until(lambda: a.settled_token == 7, 5, 0.02, "a to count both markers")
            # a wait past its end (the hand-off window's) is dropped, counted or not
            a.await_settled(d, 2, 8, time.monotonic() - 1)
            time.sleep(0.3)
            assert a.settled_token == 7
            assert [k for k, _ in etcd.range_prefix(b"/s/~settled/")] == [b"/s/~settled/" + d.encode() + b"/a",
                                                                           b"/s/~settled/" + d.encode() + b"/b"]
            # markers are neither members nor member changes, and a re-read of the set does not see them
            assert set(a.members()) == {"a", "b"} and counters["a"].get("member_changes") == changes
            assert sorted(k for k, _ in etcd.range_prefix_at(b"/s/", b"/s/~")[1]) == [b"/s/a", b"/s/b"]
            # a newer set's marker replaces the older one; unsettle deletes it
            d2 = set_digest(["a", "b", "c"])
            assert b.publish_settled(d2)
            assert sorted(k for k, _ in etcd.range_prefix(b"/s/~settled/")) == sorted(
                [b"/s/~settled/" + d.encode() + b"/a", b"/s/~settled/" + d2.encode() + b"/b"])
            etcd.put(b"/s/~settled/" + d.encode() + b"/b", b"", b.lease)  # left from an earlier time d was current
            b.unsettle(also=d)                            # its marker, and one for the set it changed to
            assert [k for k, _ in etcd.range_prefix(b"/s/~settled/")] == [b"/s/~settled/" + d.encode() + b"/a"]
            # a's lease lost (as after an etcd outage longer than the TTL): the marker leaves with it, and comes
            # back with the lease a registers again
            old_lease = a.lease
            etcd.revoke(old_lease)
            wait_until(lambda: a.lease not in (0, old_lease), 10, 0.02, "a to register again")
            wait_until(lambda: [k for k, _ in etcd.range_prefix(b"/s/~settled/")] == [
                b"/s/~settled/" + d.encode() + b"/a"], 5, 0.02, "a's marker under its new lease")
            a.stop()                                      # the lease revoked: its marker goes with it
            assert etcd.range_prefix(b"/s/~settled/") == []
        finally:
            b.stop()
            a.stop()
