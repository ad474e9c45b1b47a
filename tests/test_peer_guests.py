"""Copies a node holds of blocks it does not own (kvstore/peer/guests.py, Engine.let_go), on a real engine and
arena buffer (tests/peer_rig.py): dropped now, hidden from later lookups while a reader holds them, or first to
go; pinned and retained entries untouched; nothing counted as a delete or a hint; only non-owned keys touched.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from kvstore.peer.change import MemberView
from kvstore.peer.counters import PeerCounters
from kvstore.peer.guests import Guests
from kvstore.peer.placement import owners
from kvstore.testing import wait_until
from tests.peer_helpers import Cluster, blocks, needs_etcd, needs_ucx, register
from tests.peer_rig import NS, Node, make_node

MiB = 1 << 20


@pytest.fixture
def node():
    n = make_node("g", data_bytes=8 * MiB)
    yield n
    n.close()


def _fill(n: Node, count: int) -> list[bytes]:
    keys = [b"k%03d" % i for i in range(count)]
    for k in keys:
        n.put(k, k * (MiB // len(k)))   # one slot (1 MiB) each
    return keys


def test_dropped_copies_go_now_and_count_as_neither_deletes_nor_hints(node: Node) -> None:
    keys = _fill(node, 4)
    before = node.engine.stats()
    assert node.engine.let_go(NS, keys[:2] + [b"absent"], drop=True) == 2
    assert node.engine.exists(NS, keys) == [False, False, True, True]
    after = node.engine.stats()
    assert after.blocks == before.blocks - 2 and after.allocated_bytes == before.allocated_bytes - 2 * MiB
    assert after.counters["deleted_blocks"] == before.counters["deleted_blocks"]
    assert {k: v for k, v in after.counters.items() if k.startswith("hint_") and v} == {}
    assert node.engine.let_go("never-registered", keys, drop=True) == 0


def test_a_copy_a_reader_holds_is_hidden_at_once_and_freed_when_it_lets_go(node: Node) -> None:
    keys = _fill(node, 2)
    r = node.engine.lookup(NS, keys, lease=True)
    assert r.present == [True, True]
    allocated = node.engine.stats().allocated_bytes
    assert node.engine.let_go(NS, keys, drop=True) == 2
    assert node.engine.exists(NS, keys) == [False, False]              # no later lookup counts it
    assert node.engine.lookup(NS, keys, lease=False).present == [False, False]
    off = r.offsets[0]
    assert bytes(node.view[off: off + 4]) == keys[0] * 1                 # the reader's bytes are still there
    assert node.engine.stats().allocated_bytes == allocated              # its slots too, until it lets go
    node.engine.release([r.lease_id])
    assert node.engine.stats().allocated_bytes == allocated - 2 * MiB


def test_first_to_go_copies_are_evicted_before_older_owned_ones(node: Node) -> None:
    keys = _fill(node, 8)                      # the arena is full (8 x 1 MiB)
    assert node.engine.let_go(NS, [keys[6]]) == 1
    node.put(b"new", b"n" * MiB)               # one victim: the released copy, not the LRU tail (keys[0])
    assert node.engine.exists(NS, keys) == [True] * 6 + [False, True]


def test_pinned_and_retained_entries_are_left_as_they_are(node: Node) -> None:
    keys = _fill(node, 3)
    assert node.engine.pin(NS, [keys[0]], 1) == 1
    assert node.engine.hint(NS, [keys[1]], "retain", 60) == ["accepted"]
    assert node.engine.let_go(NS, keys, drop=True) == 1
    assert node.engine.exists(NS, keys) == [True, True, False]


@pytest.mark.parametrize("mode, gone", [("drop", True), ("guest", False), ("keep", False)])
def test_guests_let_go_only_of_the_keys_this_node_does_not_own(node: Node, mode: str, gone: bool) -> None:
    keys = _fill(node, 8)
    view = MemberView("g", 1, 60.0)
    view.apply(["g", "h", "i"])
    counters = PeerCounters()
    Guests(node.local, view, counters, mode).sent(NS, keys)
    mine = [owners(NS, k, ["g", "h", "i"], 1)[0] == "g" for k in keys]
    assert 0 < sum(mine) < len(keys)
    held = node.engine.exists(NS, keys)
    assert held == [m or not gone for m in mine]
    assert counters.get("guest_copies") == (0 if mode == "keep" else mine.count(False))
    with pytest.raises(ValueError, match="peer_local_copies"):
        Guests(node.local, view, counters, "discard")


@needs_etcd
@pytest.mark.parametrize("plane", ["tcp", "grpc", pytest.param("ucx", marks=needs_ucx)])
def test_a_cluster_holds_each_block_once_at_its_owner_on_every_plane(plane: str) -> None:
    """Three daemons, the default peer_local_copies ("drop"): after a put on a, a keeps only what it owns; after
    c reads everything (exact bytes), c too keeps only what it owns; every block is at its owner."""
    with ExitStack() as stack:
        cl = Cluster(stack, plane=plane, timeout_s=5.0, peer_handoff_window_s=0)
        ns = "once@d/t"
        register(cl.clients, ns)
        keys = [b"once-%02d" % i for i in range(24)]
        values = blocks(24, 64 << 10, seed=9)
        cl.clients["a"].put_many(ns, keys, values)
        cl.wait_pushes("a")
        where = {n: [cl.owner(ns, k) == n for k in keys] for n in "abc"}
        assert 0 < sum(where["a"]) < 24
        wait_until(lambda: cl.clients["a"].exists(ns, keys) == where["a"], 10, 0.05, "a to drop what it pushed")
        assert cl.clients["c"].get_many(ns, keys) == values
        wait_until(lambda: cl.clients["c"].exists(ns, keys) == where["c"], 10, 0.05, "c to drop what it read")
        assert cl.clients["b"].exists(ns, keys) == where["b"]
        assert cl.counters("a")["guest_copies"] == 24 - sum(where["a"])
        assert cl.counters("c")["guest_copies"] == 24 - sum(where["c"])
