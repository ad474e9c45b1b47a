"""Settling after a membership change, piece by piece: the set digest, the hand-off thread's settle (a complete pass, the grace, a catch-up pass
over what arrived meanwhile, then the callback) and what keeps it from settling (a block not delivered, a newer
change during the grace), between real in-process nodes (a real engine each, a real TCP data plane;
tests/peer_rig.py). The etcd markers, the daemons and reads around it: tests/test_peer_settle.py.
"""

from __future__ import annotations

import threading

from kvstore.peer.change import MemberChange, MemberView, set_digest
from kvstore.peer.handoff import HandOff
from kvstore.peer.intake import HandOffIntake
from kvstore.peer.placement import owners
from kvstore.testing import wait_until
from tests.peer_deadline_helpers import nodes_fixture
from tests.peer_rig import NS

nodes = nodes_fixture()
KEYS = [b"key-%04d" % i for i in range(600)]


def _owned_by(names: list[str], want: str) -> list[bytes]:
    return [k for k in KEYS if owners(NS, k, names, 1)[0] == want]


def test_the_set_digest_names_a_set_whatever_its_order() -> None:
    assert set_digest(["b", "a", "c"]) == set_digest(frozenset({"c", "a", "b"}))
    assert set_digest(["a", "b"]) != set_digest(["a", "b", "c"])
    assert len(set_digest(["a"])) == 16 and int(set_digest(["a"]), 16) >= 0
    v = MemberView("a", 1, 60.0)
    v.apply(["a", "b"])
    assert v.state() == (frozenset({"a", "b"}), set_digest(["a", "b"]), 1)
    # a set that comes back (b leaves and rejoins) has its digest again but a new epoch: settled again, not reused
    v.apply(["a"])
    v.apply(["a", "b"])
    assert v.apply(["b", "a"]) is None
    assert v.state() == (frozenset({"a", "b"}), set_digest(["a", "b"]), 3)


def _x_joined(node, members: dict, settled: list, grace_s: float) -> HandOff:
    """`node`'s hand-off thread, started on the change {a} -> {a, x}; each settle is appended to `settled`."""
    h = HandOff(node.local, node.plane, lambda: members, node.member.node_id, copies=1, bytes_per_s=1 << 30,
                counters=node.counters, batch_keys=8, settled=settled.append, settle_grace_s=grace_s)
    h.schedule(MemberChange(frozenset({"a"}), frozenset({"a", "x"})))
    h.start()
    return h


def test_a_complete_pass_settles_after_a_catch_up_that_hands_over_what_arrived_meanwhile(nodes) -> None:
    a, x = nodes("a"), nodes("x")
    members = {n.member.node_id: n.member for n in (a, x)}
    view = MemberView("x", 1, 60.0)
    view.apply(members)
    x.local.set_handoff_gate(HandOffIntake(view, x.counters, 1 << 30))
    moving = _owned_by(["a", "x"], "x")
    first, late = moving[:12], moving[12:15]
    for k in first:
        a.put(k, b"f" * 900)
    settled: list[frozenset[str]] = []
    h = _x_joined(a, members, settled, grace_s=3.0)
    try:
        wait_until(lambda: a.counters.get("handoff_scans") == 1 and h.pending == 0, 10, 0.01, "the first pass")
        assert settled == [] and x.engine.exists(NS, first) == [True] * 12
        for k in late:          # a push to the old owner that landed after its walk, during the grace
            a.put(k, b"l" * 700)
        wait_until(lambda: settled, 10, 0.02, "the settle")
    finally:
        h.stop()
    assert settled == [frozenset({"a", "x"})]
    assert [x.read(k) for k in late] == [b"l" * 700] * 3       # the catch-up handed them over
    c = a.counters.snapshot()
    assert (c["handoff_scans"], c["handoff_catch_ups"], c["handoff_settles"], c["handoff_blocks"]) == (1, 1, 1, 15)
    assert c["handoff_keys_scanned"] == 15                    # the catch-up looked at the three new keys only


def test_a_block_not_delivered_keeps_the_node_unsettled(nodes) -> None:
    a = nodes("a")
    gone = {"a": a.member}   # the new owner "x" left again before the pass: its blocks cannot be delivered
    for k in _owned_by(["a", "x"], "x")[:5]:
        a.put(k, b"v" * 100)
    settled: list[frozenset[str]] = []
    h = _x_joined(a, gone, settled, grace_s=0.05)
    try:
        wait_until(lambda: a.counters.get("handoff_dropped") == 5 and h.pending == 0, 10, 0.01, "the pass")
        threading.Event().wait(0.3)  # well past the grace: nothing may settle
    finally:
        h.stop()
    assert settled == [] and a.counters.get("handoff_settles") == 0 and a.counters.get("handoff_catch_ups") == 0


def test_a_newer_change_during_the_grace_takes_the_older_along_and_settles_the_newer_set(nodes) -> None:
    a, x, y = nodes("a"), nodes("x"), nodes("y")
    members = {n.member.node_id: n.member for n in (a, x, y)}
    settled: list[frozenset[str]] = []
    h = _x_joined(a, members, settled, grace_s=3.0)
    try:
        wait_until(lambda: a.counters.get("handoff_scans") == 1 and h.pending == 0, 10, 0.01, "the first pass")
        h.schedule(MemberChange(frozenset({"a", "x"}), frozenset({"a", "x", "y"})))
        wait_until(lambda: settled, 10, 0.02, "the settle")
        threading.Event().wait(0.2)
    finally:
        h.stop()
    assert settled == [frozenset({"a", "x", "y"})]
    assert (a.counters.get("handoff_scans"), a.counters.get("handoff_settles")) == (2, 1)
    assert h.last is not None and h.last.change == "+x +y"   # the cut settle's change went along, composed
