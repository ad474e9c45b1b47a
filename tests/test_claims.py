"""Claims, piece by piece: the daemon's table (kvstore/engine/claims.py) with a clock the test moves, the claiming
probe's frames (kvstore/peer/frames.py, protocol.py: exact bytes, every malformed field refused), the connector's
run and wait (kvstore_connector/claims.py). Across real daemons and etcd: tests/test_peer_claims.py; through the
scheduler and worker sides: tests/test_connector_claims.py."""

from __future__ import annotations

import struct

import pytest

from kvstore.engine.claims import CLAIMED, HELD, PENDING, ClaimTable, check_claim
from kvstore.errors import InvalidRequestError
from kvstore.peer import frames as fr
from kvstore.peer import protocol as proto
from kvstore.peer.frames import FrameError, Header
from kvstore_connector.claims import await_claimed, loadable_run, wait_ready
from kvstore_connector.plan import LoadJob
from kvstore_connector.stats import ConnectorCounters

K = [b"k%d" % i for i in range(6)]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_claim_is_the_claimants_and_pending_to_everyone_else_until_it_runs_out() -> None:
    clock = Clock()
    t = ClaimTable(100, clock)
    none = [None] * 4
    assert t.claim("ns", K[:4], none, b"A", 1000) == [CLAIMED] * 4
    assert t.claim("ns", K[:4], none, b"B", 1000) == [PENDING] * 4
    assert t.claim("ns", K[:4], none, b"A", 1000) == [CLAIMED] * 4       # its own claim: renewed, never pending
    assert t.claim("other-ns", K[:4], none, b"B", 1000) == [CLAIMED] * 4  # namespaces apart
    clock.t += 0.999
    assert t.claim("ns", K[2:4], [None] * 2, b"B", 1000) == [PENDING] * 2
    clock.t += 0.002                                                     # A's claim has run out: B's now
    assert t.claim("ns", K[:4], none, b"B", 1000) == [CLAIMED] * 4
    assert t.claim("ns", K[:4], none, b"A", 1000) == [PENDING] * 4
    assert len(t) == 4 and t.refused == 0     # the expired other-ns claims left as the new ones came


def test_expired_claims_leave_the_table_as_new_ones_come() -> None:
    clock = Clock()
    t = ClaimTable(1000, clock)
    for i in range(50):                         # a claim a millisecond, each for 10 ms
        t.claim("ns", [b"c%d" % i], [None], b"A", 10)
        clock.t += 0.001
        assert len(t) <= 11                     # those made in the last 10 ms, and at most one more
    assert t.refused == 0


def test_what_the_caller_knows_wins_over_the_table() -> None:
    t = ClaimTable(100, Clock())
    assert t.claim("ns", K[:3], [None, None, None], b"A", 1000) == [CLAIMED] * 3
    # held here (a save landed) or pending at the owner: answered as given, nothing recorded for those keys
    assert t.claim("ns", K[:4], [HELD, None, PENDING, None], b"B", 1000) == [HELD, PENDING, PENDING, CLAIMED]
    assert len(t) == 4


def test_a_full_table_refuses_new_claims_after_dropping_expired_ones() -> None:
    clock = Clock()
    t = ClaimTable(3, clock)
    assert t.claim("ns", K[:3], [None] * 3, b"A", 500) == [CLAIMED] * 3
    assert t.claim("ns", K[3:5], [None] * 2, b"A", 500) == [CLAIMED] * 2  # the caller computes; not recorded
    assert t.refused == 2 and len(t) == 3
    assert t.claim("ns", K[3:5], [None] * 2, b"B", 500) == [CLAIMED] * 2  # so nobody waits for them
    clock.t += 1.0                                                       # the three ran out: room again
    assert t.claim("ns", K[3:6], [None] * 3, b"A", 500) == [CLAIMED] * 3
    assert len(t) == 3 and t.refused == 4
    assert t.claim("ns", K[3:6], [None] * 3, b"B", 500) == [PENDING] * 3


@pytest.mark.parametrize("claimant,ttl", [(b"", 10), (b"x" * 65, 10), (b"x", 0), (b"x", 600_001)])
def test_bad_claims_are_refused_with_what_to_send(claimant: bytes, ttl: int) -> None:
    with pytest.raises(InvalidRequestError, match="claimant of|claim ttl_ms"):
        check_claim(claimant, ttl)


def test_a_claiming_probe_round_trips_and_is_served_from_the_local_store() -> None:
    req = proto.claim_request(7, "ns", K[:3], b"sched-1", 2500)
    assert req.header.flags == fr.CLAIM and req.header.op == fr.PROBE
    assert req.meta == b"\x02\x00ns" + b"".join(bytes([len(k)]) + k for k in K[:3]) + b"\x07sched-1" + \
        struct.pack("<I", 2500)
    assert fr.decode_claim(req.meta, 3) == ("ns", K[:3], b"sched-1", 2500)

    class Local:
        asked: list = []

        def claim(self, ns, keys, claimant, ttl_ms):
            self.asked.append((ns, keys, claimant, ttl_ms))
            return [HELD, PENDING, CLAIMED]

    limits = proto.Limits(max_keys=16, max_block_bytes=1 << 20)
    h = proto.parse_request(req.header.pack(), limits)
    ans = proto.serve(h, req.meta, Local(), limits)  # type: ignore[arg-type]
    assert Local.asked == [("ns", K[:3], b"sched-1", 2500)]
    reply = proto.parse_reply(ans.frame.header.pack(), req.header, limits)
    assert proto.claim_result(reply, ans.frame.meta) == [HELD, PENDING, CLAIMED]


def test_malformed_claiming_probes_are_frame_errors() -> None:
    limits = proto.Limits(max_keys=16, max_block_bytes=1 << 20)

    class Local:
        def claim(self, *a):  # pragma: no cover - never reached: every frame below is refused first
            raise AssertionError("a malformed claim reached the store")

    def served(meta: bytes, flags: int = fr.CLAIM, count: int = 1) -> None:
        proto.serve(Header(fr.PROBE, 1, count, len(meta), 0, flags), meta, Local(), limits)  # type: ignore[arg-type]

    good = fr.encode_claim("ns", [b"k"], b"c", 10)
    with pytest.raises(FrameError, match="claimant of 0 bytes"):
        served(fr.encode_claim("ns", [b"k"], b"", 10))
    with pytest.raises(FrameError, match="claim ttl_ms 0"):
        served(fr.encode_claim("ns", [b"k"], b"c", 0))
    with pytest.raises(FrameError, match="unexpected bytes"):
        served(good + b"x")
    with pytest.raises(FrameError, match="shorter than its fields"):
        served(good[:-1])
    with pytest.raises(FrameError, match="claim flag"):
        fr.check_header(Header(fr.PROBE, 1, 1, len(good), 0, fr.CLAIM | fr.TIERS).pack(), max_keys=4,
                        max_block_bytes=1 << 20)
    with pytest.raises(FrameError, match="claim flag"):
        fr.check_header(Header(fr.FETCH, 1, 1, len(good), 0, fr.CLAIM).pack(), max_keys=4, max_block_bytes=1 << 20)
    req = proto.claim_request(3, "ns", [b"k"], b"c", 10)
    with pytest.raises(FrameError, match="claim state byte above 2"):
        proto.claim_result(Header(fr.PROBE_REPLY, 3, 1, 1, 0, fr.CLAIM), b"\x03")
    with pytest.raises(FrameError, match="without claim states"):  # a plain probe's reply to a claim
        proto.parse_reply(Header(fr.PROBE_REPLY, 3, 1, 1, 0).pack(), req.header, limits)


def test_the_loadable_run_stops_at_the_first_key_to_compute() -> None:
    assert loadable_run([PENDING, HELD, PENDING, CLAIMED, PENDING]) == 3
    assert loadable_run([CLAIMED, PENDING]) == 0
    assert loadable_run([HELD, HELD]) == 2 and loadable_run([]) == 0


def test_a_waiting_load_takes_what_came_and_fails_the_rest() -> None:
    clock = Clock()
    answers = iter([[True, False, False, False], [True, True, False, False], [True, True, True, False],
                    [True, True, True, False], [True, True, True, False]])
    waited: list[float] = []

    def sleep(s: float) -> None:
        waited.append(s)
        clock.t += s

    assert wait_ready(lambda: next(answers), clock.t + 0.06, poll_s=0.01, clock=clock, sleep=sleep,
                      max_poll_s=0.02) == 3
    # checked at 0, 10, 25, 45 ms (pauses growing 1.5x up to 20 ms) and at the deadline (60 ms)
    assert waited == pytest.approx([0.01, 0.015, 0.02, 0.015])
    # all four keys at the first check: no wait
    assert wait_ready(lambda: [True] * 4, clock.t + 5, clock=clock, sleep=sleep) == 4 and len(waited) == 4

    counters = ConnectorCounters()
    job = LoadJob("r", None, K[:4], [[10, 11, 12, 13, 14, 15, 16, 17]], wait_s=0.0)  # 2 blocks a key
    seen = iter([[True, True, False, False]])
    got, late = await_claimed(job, lambda: next(seen), counters, clock=clock)
    assert got.keys == K[:2] and got.block_ids == [[10, 11, 12, 13]] and got.wait_s == 0
    assert late == [14, 15, 16, 17]
    assert counters.totals["claim_waits"] == 1 and counters.totals["claim_wait_missed_keys"] == 2
    assert counters.totals.get("claim_waits_served", 0) == 0
    job = LoadJob("r", None, K[:2], [[-1, 3, 4, 5]], wait_s=1.0)
    got, late = await_claimed(job, lambda: [True, True], counters, clock=clock)
    assert got is job and late == [] and counters.totals["claim_waits_served"] == 1
