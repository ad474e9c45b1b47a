"""Claims across a real cluster: three daemons on a real etcd, on each data plane. A scheduler's claim made at one
node is seen as pending from every other node (the claim rides the owner probe and is recorded at each key's
owner), turns into "held" key by key as the claimant's blocks land, runs out after its time, and bad claims are
refused with the daemons serving on. Placement is computed here with the same rendezvous hash: every count exact.
"""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack

import pytest

from kvstore.engine.claims import CLAIMED, HELD, PENDING
from kvstore.errors import InvalidRequestError, UnknownNamespaceError
from kvstore.peer import frames as fr
from kvstore.testing import wait_until
from tests.peer_helpers import Cluster, blocks, needs_etcd, needs_ucx, register

pytestmark = [needs_etcd]

PLANES = ["tcp", "grpc", pytest.param("ucx", marks=needs_ucx)]


@pytest.fixture(scope="module", params=PLANES)
def cluster(request):
    with ExitStack() as stack:
        yield Cluster(stack, plane=request.param, timeout_s=5.0, peer_handoff_window_s=0, peer_local_copies="keep")


def _keys(tag: str, n: int) -> list[bytes]:
    return [b"%s-%03d" % (tag.encode(), i) for i in range(n)]


def test_a_claim_made_at_one_node_is_pending_from_every_other_until_its_blocks_land(cluster: Cluster) -> None:
    a, b, c = (cluster.clients[n] for n in "abc")
    ns = f"claims-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    keys = _keys("p", 12)
    owners = [cluster.owner(ns, k) for k in keys]
    assert set(owners) == {"a", "b", "c"}, "the test needs keys owned by every node"
    peers_of_a = {o for o in owners if o != "a"}
    before = {n: cluster.counters(n) for n in "abc"}
    engine_before = b.stats().counters
    assert a.claim([ns], keys, b"sched-A", 30_000) == [CLAIMED] * 12
    assert cluster.counters("a")["claim_calls"] - before["a"]["claim_calls"] == len(peers_of_a)  # one per owner
    # every other node (another server's scheduler) finds all twelve pending, wherever they are owned
    assert b.claim([ns], keys, b"sched-B", 30_000) == [PENDING] * 12
    assert c.claim([ns], keys, b"sched-C", 30_000) == [PENDING] * 12
    # b's answer: keys it owns from its own table (a's claim was recorded there), the others from their owners
    assert cluster.counters("b")["claim_pending_keys"] - before["b"]["claim_pending_keys"] == owners.count("a") + \
        owners.count("c")
    # b's engine answered its own Claim (12 pending), c's probe of the keys b owns (pending) and a's (claimed)
    got = b.stats().counters
    assert got["claim_pending_keys"] - engine_before["claim_pending_keys"] == 12 + owners.count("b")
    assert got["claim_claimed_keys"] - engine_before["claim_claimed_keys"] == owners.count("b")
    # the claimant asking again renews its claim: never pending to itself
    assert a.claim([ns], keys, b"sched-A", 30_000) == [CLAIMED] * 12
    # a saves the first five: held from everywhere, the other seven still pending
    values = blocks(5, 64 << 10, seed=7)
    a.put_many(ns, keys[:5], values)
    cluster.wait_pushes("a")
    assert b.claim([ns], keys, b"sched-B", 30_000) == [HELD] * 5 + [PENDING] * 7
    assert c.exists(ns, keys[:5], cluster=True) == [True] * 5
    assert c.get_many(ns, keys[:5]) == values


def test_a_claim_runs_out_and_then_the_next_claimant_has_it(cluster: Cluster) -> None:
    a, b, c = (cluster.clients[n] for n in "abc")
    ns = f"expiry-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    keys = _keys("e", 9)
    assert a.claim([ns], keys, b"sched-A", 300) == [CLAIMED] * 9
    assert b.claim([ns], keys, b"sched-B", 300) == [PENDING] * 9
    time.sleep(0.35)
    assert b.claim([ns], keys, b"sched-B", 5_000) == [CLAIMED] * 9     # a's ran out: b computes them
    assert c.claim([ns], keys, b"sched-C", 5_000) == [PENDING] * 9     # and now waits for b
    assert a.claim([ns], keys, b"sched-A", 5_000) == [PENDING] * 9


def test_a_claim_across_shards_is_pending_only_where_every_shard_is_loadable(cluster: Cluster) -> None:
    a, b = cluster.clients["a"], cluster.clients["b"]
    ns0, ns1 = f"tp0-{time.monotonic_ns()}", f"tp1-{time.monotonic_ns()}"
    register(cluster.clients, ns0), register(cluster.clients, ns1)
    keys = _keys("s", 4)
    assert a.claim([ns0], keys[:2], b"sched-A", 30_000) == [CLAIMED] * 2       # rank 0 only, two keys
    assert a.claim([ns1], keys[:1], b"sched-A", 30_000) == [CLAIMED]           # rank 1, one key
    b.put_many(ns0, keys[3:], blocks(1, 4096, seed=8))
    cluster.wait_pushes("b")
    # key 0 pending in both; key 1 pending in rank 0 but b's to compute in rank 1 (so b computes it in both)
    assert b.claim([ns0, ns1], keys, b"sched-B", 30_000) == [PENDING, CLAIMED, CLAIMED, CLAIMED]


def test_bad_claims_are_refused_and_every_node_serves_on(cluster: Cluster) -> None:
    a = cluster.clients["a"]
    ns = f"bad-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    with pytest.raises(InvalidRequestError, match="claimant of 0 bytes"):
        a.claim([ns], [b"k"], b"", 100)
    with pytest.raises(InvalidRequestError, match="claimant of 65 bytes"):
        a.claim([ns], [b"k"], b"x" * 65, 100)
    with pytest.raises(InvalidRequestError, match="claim ttl_ms 0"):
        a.claim([ns], [b"k"], b"x", 0)
    with pytest.raises(InvalidRequestError, match="names no namespace"):
        a.claim([], [b"k"], b"x", 100)
    with pytest.raises(UnknownNamespaceError):
        a.claim(["never-registered"], [b"k"], b"x", 100)
    with pytest.raises(InvalidRequestError):
        a.claim([ns], [b""], b"x", 100)                                       # an empty key
    assert a.claim([ns], [b"k"], b"x", 100) == [CLAIMED]                       # and a good one still works
    if a.stats().peers.data_plane != "tcp":
        return
    # a peer's claiming probe with a bad claimant: the connection is closed, counted, and b serves on
    host, _, port = cluster.clients["b"].health().peers.data_address.rpartition(":")
    before = cluster.counters("b")["frame_errors"]
    meta = fr.encode_claim(ns, [b"k"], b"", 100)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(fr.Header(fr.PROBE, 1, 1, len(meta), 0, fr.CLAIM).pack() + meta)
        s.settimeout(5)
        assert s.recv(1) == b""
    wait_until(lambda: cluster.counters("b")["frame_errors"] - before == 1, 5, what="the frame error counted")
    assert cluster.clients["c"].claim([ns], [b"k2"], b"y", 1000) == [CLAIMED]
    assert cluster.clients["b"].claim([ns], [b"k2"], b"z", 1000) == [PENDING]
