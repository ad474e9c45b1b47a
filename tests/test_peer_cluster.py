"""Three real daemons and a real etcd on loopback: blocks put on one node are read on another.

Every scenario runs on the TCP data plane, the gRPC-stream fallback and, when ucxx is installed, on the UCX
plane (same tests).
Placement is computed here with the same rendezvous hash, so every count is exact.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from kvstore.testing import wait_until
from tests.peer_helpers import Cluster, blocks, needs_etcd, needs_ucx, register

pytestmark = [needs_etcd]

PLANES = ["tcp", "grpc", pytest.param("ucx", marks=needs_ucx)]


@pytest.fixture(scope="module", params=PLANES)
def cluster(request):
    with ExitStack() as stack:
        # a generous per-call bound: on a loaded 2-core CI box a 1 s call can time out and turn a hit into a miss.
        # No hand-off window: these are the steady-state counts (a cluster that just formed would otherwise ask
        # the previous owners of the last joiner's keys too: tests/test_peer_membership_change.py). Copies of
        # blocks a node does not own are kept as ordinary entries, so what a read fetched is a local hit after
        # it; the default drops them (tests/test_peer_guests.py, test_peer_membership_change.py).
        yield Cluster(stack, plane=request.param, timeout_s=5.0, peer_handoff_window_s=0, peer_local_copies="keep")


def test_members_and_health(cluster: Cluster) -> None:
    h = cluster.clients["a"].health()
    assert h.peers is not None and h.peers.etcd_connected
    assert sorted(m.node_id for m in h.peers.members) == sorted(cluster.ids)
    assert [m.is_self for m in h.peers.members if m.node_id == cluster.ids[0]] == [True]
    s = cluster.clients["c"].stats()
    assert s.peers.data_plane == cluster.nodes["c"].args[cluster.nodes["c"].args.index("--peer-data-plane") + 1]


def test_owner_pushes_land_on_the_owner_and_c_reads_a_block_put_on_a(cluster: Cluster) -> None:
    a, b, c = (cluster.clients[n] for n in "abc")
    ns = f"push-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    keys = [b"blk-%02d" % i for i in range(16)]
    values = blocks(16, 256 << 10, seed=1)
    before = {n: cluster.counters(n) for n in "abc"}
    a.put_many(ns, keys, values)
    cluster.wait_pushes("a")
    owners = [cluster.owner(ns, k) for k in keys]
    # put on a -> pushed to its owner (b or c); nobody else holds it
    for name in "bc":
        assert cluster.clients[name].exists(ns, keys) == [o == name for o in owners]
    pushed = sum(o != "a" for o in owners)
    after_a = cluster.counters("a")
    assert after_a["pushed_blocks"] - before["a"]["pushed_blocks"] == pushed
    assert after_a["pushes_dropped"] == before["a"]["pushes_dropped"]
    if a.stats().peers.data_plane != "grpc":  # the grpc fallback lands pushes as ordinary Put streams
        for name in "bc":
            got = cluster.counters(name)["received_pushes"] - before[name]["received_pushes"]
            assert got == owners.count(name)
    # c reads everything: its own pushes locally, the rest from the owners (a for a-owned blocks)
    missing_on_c = [k for k, o in zip(keys, owners) if o != "c"]
    assert c.get_many(ns, keys) == values
    after_c = cluster.counters("c")
    assert after_c["fetched_blocks"] - before["c"]["fetched_blocks"] == len(missing_on_c)
    assert after_c["fetch_calls"] - before["c"]["fetch_calls"] == len({o for o in owners if o != "c"})
    assert after_c["fetch_misses"] == before["c"]["fetch_misses"]
    # now local hits: a second read asks nobody
    assert c.exists(ns, keys) == [True] * 16
    assert c.get_many(ns, keys) == values
    assert cluster.counters("c")["fetch_calls"] == after_c["fetch_calls"]
    # a block no node has is a plain miss
    assert c.get_many(ns, [b"nobody-has-it"]) == [None]


def test_prefix_lookup_across_nodes_one_call_per_peer(cluster: Cluster) -> None:
    """A Lookup without lease (a scheduler's) probes each peer once, answers, and fetches in the background."""
    a, b, c = (cluster.clients[n] for n in "abc")
    ns = f"prefix-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    chain = [b"chain-%03d" % i for i in range(40)]
    values = blocks(40, 64 << 10, seed=2)
    b.put_many(ns, chain[:30], values[:30])  # the first 30 of the chain exist (on b and their owners)
    b.put_many(ns, chain[31:], values[31:])  # and 9 more after a gap: a prefix Lookup must not fetch those
    cluster.wait_pushes("b")
    before = cluster.counters("a")
    remote = [k for k in chain[:30] if cluster.owner(ns, k) != "a"]
    owners = {cluster.owner(ns, k) for k in chain} - {"a"}
    assert a.lookup_prefix(ns, chain) == 30
    after = cluster.counters("a")
    assert after["probe_calls"] - before["probe_calls"] == len(owners)  # one batched probe per peer, not per key
    assert after["prefetch_keys"] - before["prefetch_keys"] == len(remote)  # nothing past the gap
    wait_until(lambda: cluster.counters("a")["fetched_blocks"] - before["fetched_blocks"] == len(remote),
               timeout_s=10, what="the prefetch to land")
    fetched = cluster.counters("a")
    assert fetched["fetch_calls"] - before["fetch_calls"] == len({cluster.owner(ns, k) for k in remote})
    assert a.get_many(ns, chain[:30]) == values[:30]    # local hits now: nobody is asked again
    assert cluster.counters("a")["fetch_calls"] == fetched["fetch_calls"]


def test_lookup_without_lease_reports_peer_tier_and_a_load_joins_the_prefetch(cluster: Cluster) -> None:
    a, b = cluster.clients["a"], cluster.clients["b"]
    ns = f"tiers-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    keys = [k for k in (b"t-%03d" % i for i in range(200)) if cluster.owner(ns, k) == "c"][:8]
    values = blocks(len(keys), 256 << 10, seed=4)
    b.put_many(ns, keys, values)
    cluster.wait_pushes("b")
    b.delete(ns, keys)                       # only c (the owner) holds them now
    before = cluster.counters("a")
    hits_before = a.stats().counters["hit_keys_peer"]
    probe = a.lookup(ns, keys + [b"absent"], lease=False)
    assert a.stats().counters["hit_keys_peer"] - hits_before == len(keys)
    assert probe.present == [True] * len(keys) + [False]
    assert probe.tiers == [3] * len(keys) + [0]        # TIER_PEER: being fetched into a's arena
    got = a.get_many(ns, keys)                         # the load waits for the prefetch instead of fetching again
    assert got == values
    after = cluster.counters("a")
    assert after["fetch_calls"] - before["fetch_calls"] == 1 and after["fetched_blocks"] - before["fetched_blocks"] == 8
    assert a.lookup(ns, keys, lease=False).tiers == [1] * len(keys)   # RAM hits now


def test_remote_put_through_stream_reaches_the_owner(cluster: Cluster) -> None:
    """A block written on c through the gRPC stream (no arena) is pushed like any other put."""
    ns = f"stream-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    from kvstore.client import Client
    key, value = b"streamed", blocks(1, 100_000, seed=3)[0]
    with Client(cluster.nodes["c"].tcp_address, mode="stream") as remote:
        assert remote.mode == "stream"
        remote.put_many(ns, [key], [value])
    cluster.wait_pushes("c")
    owner = cluster.owner(ns, key)
    assert cluster.clients[owner].exists(ns, [key]) == [True]
    reader = next(n for n in "abc" if n not in (owner, "c"))
    assert cluster.clients[reader].get_many(ns, [key]) == [value]
