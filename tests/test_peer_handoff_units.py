"""The membership-change pieces on their own: placement's hand-off and read order, the member view and its
window, the intake's ownership and rate checks, the HANDOFF frame, and a hand-off pass and a fallback read
between real in-process nodes (a real engine each, a real TCP data plane on loopback; tests/peer_rig.py).

Scripts with exact values; a fake clock wherever time matters.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.peer import frames as fr
from kvstore.peer import protocol as proto
from kvstore.peer.change import MemberChange, MemberView
from kvstore.peer.counters import PeerCounters
from kvstore.peer.frames import FrameError, Header
from kvstore.peer.handoff import HandOff
from kvstore.peer.intake import HandOffIntake, TokenBucket
from kvstore.peer.placement import handoff_targets, owners, read_order
from kvstore.peer.remote_tier import RemoteTier
from kvstore.testing import wait_until
from tests.peer_deadline_helpers import nodes_fixture
from tests.peer_rig import DESC, NS

nodes = nodes_fixture()
KEYS = [b"key-%04d" % i for i in range(600)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# -- placement: who hands what to whom -------------------------------------------------------------------------
def _after_handoff(before: list[str], after: list[str], copies: int, writer: str) -> dict[bytes, set[str]]:
    """Per key written by `writer` and pushed to its owners under `before`: the holders once every surviving
    holder ran its hand-off for the change (holders in `after` only, as a dead node holds nothing)."""
    out: dict[bytes, set[str]] = {}
    for k in KEYS:
        held = ({writer} | set(owners(NS, k, before, copies))) & set(after)
        sent = {t for h in held for t in handoff_targets(NS, k, before, after, copies, h)}
        out[k] = held | sent
    return out


@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("event", ["join", "leave", "death of a writer's owner"])
def test_after_a_change_every_new_owner_holds_every_block_a_live_node_held(copies: int, event: str) -> None:
    five = ["n1", "n2", "n3", "n4", "n5"]
    before, after = {"join": (five[:4], five), "leave": (five, five[:4]),
                     "death of a writer's owner": (five, ["n1", "n2", "n3", "n5"])}[event]
    for writer in after:
        result = _after_handoff(before, after, copies, writer)
        for k, holders in result.items():
            assert set(owners(NS, k, after, copies)) <= holders, (k, holders)


def test_only_an_old_owner_sends_while_one_survives_and_every_holder_when_none_does() -> None:
    four, three = ["a", "b", "c", "d"], ["a", "b", "c"]
    for k in KEYS:  # d dies: a block d owned goes to its new owner from every survivor that holds it
        old, new = owners(NS, k, four, 1)[0], owners(NS, k, three, 1)
        for h in three:
            assert handoff_targets(NS, k, four, three, 1, h) == ([] if old != "d" or h in new else new)
    five = four + ["e"]
    for k in KEYS:  # a join: a block e now owns goes to e from its previous owner only; writers' copies stay
        old, new = owners(NS, k, four, 1)[0], owners(NS, k, five, 1)
        for h in four:
            assert handoff_targets(NS, k, four, five, 1, h) == (new if new == ["e"] and h == old else [])
    # owner+1: a death takes one of two owners; the survivor restores the second copy
    for k in KEYS[:200]:
        old, new = owners(NS, k, four, 2), owners(NS, k, three, 2)
        for h in three:
            want = [m for m in new if m not in old and m != h] if h in old else []
            assert handoff_targets(NS, k, four, three, 2, h) == want
    assert handoff_targets(NS, KEYS[0], four, five, 0, "a") == []  # replication off: nothing to hand off


def test_composed_changes_still_move_what_an_intermediate_set_gave_this_node() -> None:
    """a leaves ({a,b,c} -> {b,c}: b takes some of a's blocks) and comes back ({b,c} -> {a,b,c}) before b's
    hand-off thread runs: one composed pass whose before equals its after. b hands back what it owned only in
    between; a copy b never owned stays put."""
    three, two = frozenset("abc"), frozenset("bc")
    change = MemberChange(three, two).compose(MemberChange(two, three))
    assert (change.before, change.after, change.via) == (three, three, (two,))
    for k in KEYS:
        between = owners(NS, k, two, 1)[0]
        now = owners(NS, k, three, 1)
        got = handoff_targets(NS, k, change.before, change.after, 1, "b", change.via)
        assert got == (now if between == "b" and now != ["b"] else [])


def test_read_order_asks_the_owner_then_the_previous_owners_still_alive() -> None:
    four, five = ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]
    k = next(k for k in KEYS if owners(NS, k, five, 1)[0] == "e" and owners(NS, k, four, 1)[0] == "b")
    assert read_order(NS, k, five, [], 1, "a") == ["e"]
    assert read_order(NS, k, five, [frozenset(four)], 1, "a") == ["e", "b"]
    assert read_order(NS, k, five, [frozenset(four)], 1, "e") == ["b"]        # the new owner asks the old one
    assert read_order(NS, k, five, [frozenset(four)], 1, "b") == ["e"]
    assert read_order(NS, k, ["a", "c", "d", "e"], [frozenset(five)], 1, "a") == ["e"]  # b gone: not asked
    r2 = owners(NS, k, five, 2)
    assert read_order(NS, k, five, [], 2, "e") == [r2[1]]                   # owner+1: the replica


# -- the member view ----------------------------------------------------------------------------------------------
def test_member_view_keeps_earlier_sets_for_the_window_only() -> None:
    clock = Clock()
    v = MemberView("a", 1, window_s=10.0, clock=clock)
    assert v.current() == {"a"}
    assert v.apply(["a"]) is None
    ch = v.apply(["a", "b", "c"])
    assert ch == MemberChange(frozenset({"a"}), frozenset({"a", "b", "c"})) and ch.joined == {"b", "c"}
    clock.t += 5
    ch2 = v.apply(["a", "c", "d"])
    assert (ch2.joined, ch2.left, ch2.describe()) == ({"d"}, {"b"}, "+d -b")
    # not {a}, this node's view before it first read etcd, but the cluster it joined: {b, c} (without it)
    assert v.previous() == [frozenset({"a", "b", "c"}), frozenset({"b", "c"})]
    assert ch.compose(ch2) == MemberChange(frozenset({"a"}), frozenset({"a", "c", "d"}), (frozenset({"a", "b", "c"}),))
    clock.t += 6
    assert v.previous() == [frozenset({"a", "b", "c"})]  # {b, c} left the window (10 s after it was current)
    v.apply(["a", "c"])
    assert v.previous() == [frozenset({"a", "c", "d"}), frozenset({"a", "b", "c"})]
    clock.t += 5
    assert v.previous() == [frozenset({"a", "c", "d"})]  # {a, b, c} left the window (10 s after it was current)
    clock.t += 6
    assert v.previous() == []


def test_the_intake_takes_what_this_node_owns_one_rank_past_it_or_owned_in_the_window() -> None:
    clock = Clock()
    four = ["a", "b", "c", "d"]
    v = MemberView("c", 1, window_s=10.0, clock=clock)
    v.apply(four)
    counters = PeerCounters()
    intake = HandOffIntake(v, counters, bytes_per_s=1 << 30)
    ranks = {k: owners(NS, k, four, 4).index("c") for k in KEYS[:200]}
    keys = list(ranks)
    assert intake(NS, keys, 100) == [ranks[k] <= 1 for k in keys]
    assert counters.get("handoff_refused") == sum(r > 1 for r in ranks.values())
    # d leaves: c takes what it owned under {a, b, c, d} during the window, and what it owns now
    v.apply(["a", "b", "c"])
    now = {k: owners(NS, k, ["a", "b", "c"], 3).index("c") for k in keys}
    assert intake(NS, keys, 100) == [ranks[k] == 0 or now[k] <= 1 for k in keys]
    clock.t += 11
    assert intake(NS, keys, 100) == [now[k] <= 1 for k in keys]


def test_a_flood_of_handoffs_is_refused_whole_once_the_bucket_is_empty() -> None:
    clock = Clock()
    v = MemberView("a", 1, window_s=10.0, clock=clock)
    counters = PeerCounters()
    intake = HandOffIntake(v, counters, bytes_per_s=1 << 20)
    intake._bucket = TokenBucket(1 << 20, clock=clock)  # noqa: SLF001  # the same bucket on the fake clock
    assert intake(NS, [b"k1"], 3 << 20) == [True]       # a full bucket admits a frame of any size (into debt)
    assert intake(NS, [b"k2", b"k3"], 10) == [False, False]
    assert counters.get("handoff_flood_refused") == 1
    clock.t += 2.0                                        # 2 MiB repaid, 1 MiB of debt left
    assert intake(NS, [b"k4"], 10) == [False]
    clock.t += 1.5
    assert intake(NS, [b"k5"], 10) == [True]
    assert counters.get("handoff_flood_refused") == 2
    assert TokenBucket(1 << 20, clock=clock).wait_time() == 0.0
    with pytest.raises(ValueError):
        TokenBucket(0)


# -- the HANDOFF frame --------------------------------------------------------------------------------------------
class GateLocal:
    def __init__(self, mask: list[bool]) -> None:
        self.mask = mask
        self.received: list[tuple[list[bytes], list[int]]] = []

    def admit_handoff(self, namespace: str, keys: list[bytes], payload_bytes: int) -> list[bool]:
        assert (namespace, payload_bytes) == (NS, 7)
        return self.mask

    def receive(self, namespace, keys, sizes, desc=None):
        from kvstore.peer.local import Incoming
        self.received.append((keys, sizes))
        return Incoming([memoryview(bytearray(s)) for s in sizes], 5)


def test_a_handoff_push_lands_only_the_blocks_the_receiver_admits() -> None:
    limits = proto.Limits(max_keys=4, max_block_bytes=4096)
    sizes, sums = np.array([3, 4]), np.array([1, 2], dtype=np.uint64)
    req = proto.push_request(3, DESC, [b"k1", b"k2"], sizes, sums, handoff=True)
    assert req is not None and req.header.flags == fr.HANDOFF
    local = GateLocal([False, True])
    h = proto.parse_request(req.pack()[:fr.HEADER.size], limits)
    intake = proto.serve(h, req.meta, local, limits)  # type: ignore[arg-type]  # a small fake of LocalStore
    assert isinstance(intake, proto.Intake) and intake.handoff and intake.counter == "handoff_received"
    assert intake.plan.refused == {0}
    inc = intake.plan.reserve(local)  # type: ignore[arg-type]
    assert local.received == [([b"k2"], [4])]
    assert [v is None for v, _ in intake.plan.landing(inc)] == [True, False]
    assert proto.serve(h, req.meta, GateLocal([False, False]), limits).plan.reserve(GateLocal([])) is None  # type: ignore[arg-type, union-attr]
    plain = proto.push_request(4, DESC, [b"k1"], np.array([3]), np.array([1], dtype=np.uint64))
    assert plain is not None and plain.header.flags == 0
    assert proto.serve(plain.header, plain.meta, local, limits).counter == "received_pushes"  # type: ignore[arg-type, union-attr]


@pytest.mark.parametrize("header, message", [
    (Header(fr.PROBE, 1, 1, 4, 0, fr.HANDOFF), "hand-off flag on op 5"),
    (Header(fr.FETCH, 1, 1, 4, 0, fr.HANDOFF), "hand-off flag on op 1"),
    (Header(fr.PUSH, 1, 1, 4, 0, fr.TIERS), "the tiers flag on op 3"),
    (Header(fr.PUSH, 1, 1, 4, 0, fr.CLAIM), "the claim flag on op 3"),
    (Header(fr.PUSH, 1, 1, 4, 0, 8), "unknown flags 0x8"),
    (Header(fr.PUSH, 1, 1, 4, 0, 0x8000), "unknown flags 0x8000"),
])
def test_bad_handoff_flags_are_rejected(header: Header, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        fr.check_header(header.pack(), max_keys=4, max_block_bytes=4096)


# -- real in-process nodes: a hand-off pass, a fallback read -------------------------------------------------------
def _ids_owning(names: list[str], want: str, previous: list[str] | None = None, was: str = "") -> list[bytes]:
    return [k for k in KEYS if owners(NS, k, names, 1)[0] == want
            and (previous is None or owners(NS, k, previous, 1)[0] == was)]


def test_a_handoff_pass_moves_exactly_the_new_owners_blocks_once(nodes) -> None:
    a, b, x = nodes("a"), nodes("b"), nodes("x")
    members = {n.member.node_id: n.member for n in (a, b, x)}
    for n in (a, x):
        n.local.set_handoff_gate(HandOffIntake(_view(n.member.node_id, members), n.counters, 1 << 30))
    moving = _ids_owning(["a", "b", "x"], "x", ["a", "b"], "a")[:20]
    staying = _ids_owning(["a", "b", "x"], "a")[:5]
    values = {k: bytes([i % 251]) * (3000 + i) for i, k in enumerate(moving + staying)}
    for k, v in values.items():
        a.put(k, v)
    x.put(moving[0], values[moving[0]])      # already there: probed, not sent again
    h = HandOff(a.local, a.plane, lambda: members, "a", copies=1, bytes_per_s=1 << 30, counters=a.counters,
                batch_keys=8)
    report = h._pass(MemberChange(frozenset({"a", "b"}), frozenset({"a", "b", "x"})), lambda: False)  # noqa: SLF001
    assert (report.finished, report.sent, report.present, report.dropped) == (True, 19, 1, 0)
    assert report.scanned == len(values)
    assert report.sent_bytes == sum(len(values[k]) for k in moving[1:])
    assert [x.read(k) for k in moving] == [values[k] for k in moving]
    assert x.engine.exists(NS, staying) == [False] * 5
    assert x.counters.get("handoff_received") == 19 and a.counters.get("handoff_blocks") == 19
    again = h._pass(MemberChange(frozenset({"a", "b"}), frozenset({"a", "b", "x"})), lambda: False)  # noqa: SLF001
    assert (again.sent, again.present) == (0, 20)    # a second pass sends nothing


def test_a_handoff_pass_stops_when_cut_and_the_thread_runs_the_composed_change(nodes) -> None:
    a, x = nodes("a"), nodes("x")
    members = {n.member.node_id: n.member for n in (a, x)}
    for k in _ids_owning(["a", "x"], "x")[:40]:
        a.put(k, b"v" * 100)
    h = HandOff(a.local, a.plane, lambda: members, "a", copies=1, bytes_per_s=1 << 30, counters=a.counters,
                batch_keys=8)
    report = h._pass(MemberChange(frozenset({"a"}), frozenset({"a", "x"})), lambda: True)  # noqa: SLF001
    assert not report.finished and report.sent == 0 and x.counters.get("handoff_received") == 0
    # the thread: two changes queued before it runs are one pass ({a} -> {a, x} -> {a, x}: x gets its 40)
    h.schedule(MemberChange(frozenset({"a"}), frozenset({"a", "b"})))
    h.schedule(MemberChange(frozenset({"a", "b"}), frozenset({"a", "x"})))
    assert h.pending == 1
    h.start()
    try:
        wait_until(lambda: h.pending == 0, 10, 0.02, "the hand-off thread")
    finally:
        h.stop()
    assert h.last is not None and (h.last.change, h.last.sent) == ("+x", 40)
    assert a.counters.get("handoff_scans") == 2


def _view(me: str, members: dict) -> MemberView:
    v = MemberView(me, 1, window_s=60.0)
    v.apply(members)
    return v


def _stocked(node, keys: list[bytes], first: int) -> dict[bytes, bytes]:
    """One 2 KiB block per key put on `node` (bytes first, first + 1, ...); key -> value."""
    values = {k: bytes([first + i]) * 2048 for i, k in enumerate(keys)}
    for k, v in values.items():
        node.put(k, v)
    return values


def _reader_tier(r, members: dict, plane=None, counters=None, previous=None) -> RemoteTier:
    """r's RemoteTier over `members` (on r's own plane unless given); `previous`: the window's earlier sets."""
    return RemoteTier(r.engine, plane or r.plane, lambda: members, "r", copies=1, timeout_s=2.0, max_keys=64,
                      counters=r.counters if counters is None else counters,
                      **({} if previous is None else {"previous": lambda: previous}))


def test_a_read_that_misses_at_the_new_owner_is_served_by_the_previous_one(nodes) -> None:
    a, x, r = nodes("a"), nodes("x"), nodes("r")
    members = {n.member.node_id: n.member for n in (a, x, r)}
    keys = _ids_owning(["a", "x", "r"], "x", ["a", "r"], "a")[:6]
    values = _stocked(a, keys, 7)
    tier = _reader_tier(r, members, previous=[frozenset({"a", "r"})])
    plain = _reader_tier(r, members, counters=PeerCounters())
    try:
        assert [len(ks) for _, ks in plain.locate(NS, keys)] == []      # outside a window: x is asked only
        found = tier.locate(NS, keys)
        assert [(m.node_id, sorted(ks)) for m, ks in found] == [("a", sorted(keys))]
        assert tier.fill(NS, keys).stored == 6
    finally:
        tier.close()
        plain.close()
    assert [r.read(k) for k in keys] == [values[k] for k in keys]
    pc = r.counters.snapshot()
    assert (pc["fallback_keys"], pc["fallback_hits"], pc["fetched_blocks"]) == (12, 12, 6)


def test_a_member_that_is_leaving_owns_nothing_new_but_is_still_asked_for_what_it_had() -> None:
    four, three = ["a", "b", "c", "l"], frozenset(["a", "b", "c"])
    k = next(k for k in KEYS if owners(NS, k, four, 1)[0] == "l")
    new = owners(NS, k, three, 1)[0]
    asker = next(m for m in "abc" if m != new)
    # the placement set leaves l out; l is still reachable and was the owner before: asked second
    assert read_order(NS, k, three, [frozenset(four)], 1, asker, reachable=set(four)) == [new, "l"]
    assert read_order(NS, k, three, [frozenset(four)], 1, asker) == [new]   # once it is gone: not asked


def test_pipelined_probes_answer_each_peer_in_its_slot_and_a_dead_one_with_its_error(nodes) -> None:
    from kvstore.peer.membership import Member
    from kvstore.peer.plane import PeerError
    a, b, c = nodes("a"), nodes("b"), nodes("c")
    b.put(b"kb", b"B" * 100)
    c.put(b"kc", b"C" * 100)
    dead = Member("dead", "", "127.0.0.1:1", "tcp", 0)  # nothing listens on port 1
    out = a.plane.probe_many([(b.member, NS, [b"kb", b"kc"]), (dead, NS, [b"kb"]), (c.member, NS, [b"kc", b"kb"])])
    assert out[0] == [True, False] and out[2] == [True, False]
    assert isinstance(out[1], PeerError) and "dead" in str(out[1])
    assert a.plane.probe_many([(b.member, NS, [b"kb"])] * 3) == [[True]] * 3   # three connections, one peer


class _HandOffLandsBetween:
    """r's data plane, with a hand-off landing (the block moves from `old` to `new`) right after r's first
    fetch from `new` came back empty: the race a read in a hand-off window can meet."""

    def __init__(self, plane, new, old, values: dict[bytes, bytes]) -> None:
        self._plane, self._new, self._old, self._values = plane, new, old, values
        self.asked: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._plane, name)

    def fetch(self, member, namespace: str, keys: list[bytes]) -> int:
        self.asked.append(member.node_id)
        got = self._plane.fetch(member, namespace, keys)
        if self.asked == ["x"]:
            for k in keys:
                self._new.put(k, self._values[k])
                assert self._old.engine.let_go(NS, [k], drop=True) == 1
        return got


def test_a_read_that_misses_at_the_owner_and_then_at_the_previous_one_asks_the_owner_once_more(nodes) -> None:
    a, x, r = nodes("a"), nodes("x"), nodes("r")
    members = {n.member.node_id: n.member for n in (a, x, r)}
    keys = _ids_owning(["a", "x", "r"], "x", ["a", "r"], "a")[:3]
    values = _stocked(a, keys, 40)
    plane = _HandOffLandsBetween(r.plane, x, a, values)
    tier = _reader_tier(r, members, plane, previous=[frozenset({"a", "r"})])
    try:
        filled = tier.fill(NS, keys)
    finally:
        tier.close()
    assert plane.asked == ["x", "a", "x"]       # the owner, the previous owner (dropped it meanwhile), the owner
    assert (filled.stored, filled.here) == (3, frozenset(keys))
    assert [r.read(k) for k in keys] == [values[k] for k in keys]
    pc = r.counters.snapshot()
    assert (pc["fallback_keys"], pc["fallback_hits"], pc["fetched_blocks"]) == (6, 3, 3)


def test_a_read_outside_a_window_that_misses_asks_the_owner_once(nodes) -> None:
    a, x, r = nodes("a"), nodes("x"), nodes("r")
    members = {n.member.node_id: n.member for n in (a, x, r)}
    keys = _ids_owning(["a", "x", "r"], "x")[:3]      # held nowhere
    plane = _HandOffLandsBetween(r.plane, x, a, {})
    plane.asked.append("-")                           # never moves anything
    tier = _reader_tier(r, members, plane)
    try:
        filled = tier.fill(NS, keys)
    finally:
        tier.close()
    assert plane.asked == ["-", "x"]                  # one candidate: no second ask of a genuine miss
    assert (filled.stored, filled.here) == (0, frozenset())
    assert r.counters.snapshot()["fallback_keys"] == 0
