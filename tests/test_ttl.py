"""TtlTable with an injected clock: expiry order, early removal, ids."""

from __future__ import annotations

import random

import pytest

from kvstore.engine.ttl import TtlTable


class FakeClock:
    """A settable monotonic clock (an explicit sync point instead of a sleep)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ttl_must_be_positive() -> None:
    for bad in (0, 0.0, -1.0):
        with pytest.raises(ValueError, match="ttl must be positive"):
            TtlTable(bad)


def test_expire_in_deadline_order_with_injected_clock() -> None:
    clock = FakeClock(100.0)
    t: TtlTable[str] = TtlTable(10.0, clock=clock)
    # add a at 100 (deadline 110), b at 103 (113), c at 105 (115)
    a = t.add("a")
    clock.now = 103.0
    b = t.add("b")
    clock.now = 105.0
    c = t.add("c")
    assert len(t) == 3
    # nothing is due before 110; the deadline itself is due (<=)
    assert t.expire(109.999) == []
    assert t.expire(110.0) == [(a, "a")]
    # now=None reads the injected clock: at 114 only b is due
    clock.now = 114.0
    assert t.expire() == [(b, "b")]
    assert (len(t), a in t, b in t, c in t) == (1, False, False, True)
    # far in the future: c, then nothing more
    assert t.expire(1e9) == [(c, "c")]
    assert t.expire(1e9) == [] and len(t) == 0


def test_expire_returns_every_due_item_in_insertion_order() -> None:
    clock = FakeClock(0.0)
    t: TtlTable[int] = TtlTable(1.0, clock=clock)
    ids = []
    for i in range(5):
        clock.now = float(i)
        ids.append(t.add(i))
    # deadlines 1..5: at 3.5 items 0, 1, 2 are due, in the order they were added
    assert t.expire(3.5) == [(ids[0], 0), (ids[1], 1), (ids[2], 2)]
    assert t.values() == [3, 4]


def test_pop_before_expiry_removes_the_item_for_good() -> None:
    clock = FakeClock(0.0)
    t: TtlTable[str] = TtlTable(5.0, clock=clock)
    x, y, z = t.add("x"), t.add("y"), t.add("z")
    # pop y before its deadline -> returned once, then unknown; expiry later skips it
    assert t.pop(y) == "y"
    assert t.pop(y) is None
    assert t.get(y) is None and y not in t
    assert (t.get(x), t.get(z)) == ("x", "z")
    assert t.expire(5.0) == [(x, "x"), (z, "z")]
    # pop after expiry and of an id never issued -> None
    assert t.pop(x) is None
    assert t.pop(12345) is None
    assert len(t) == 0 and t.values() == []


def test_items_added_after_an_expire_keep_their_own_deadline() -> None:
    clock = FakeClock(0.0)
    t: TtlTable[str] = TtlTable(2.0, clock=clock)
    early = t.add("early")
    assert t.expire(2.0) == [(early, "early")]
    clock.now = 10.0
    late = t.add("late")
    # 11.9 < 12: not yet; 12: due
    assert t.expire(11.9) == []
    assert t.expire(12.0) == [(late, "late")]


def test_ids_unique_consecutive_and_start_random() -> None:
    # the first id is a random 48-bit base + 1, then ids count up by one
    random.seed(1234)
    expected_first = random.getrandbits(48) + 1
    random.seed(1234)
    t: TtlTable[int] = TtlTable(1.0, clock=FakeClock())
    ids = [t.add(i) for i in range(1000)]
    assert ids[0] == expected_first
    assert ids == list(range(expected_first, expected_first + 1000))
    assert len(set(ids)) == 1000
    assert all(1 <= i <= (1 << 48) + 1000 for i in ids)
    # ids of removed items are never reissued
    for i in ids[:10]:
        t.pop(i)
    assert t.add(-1) == ids[-1] + 1
    # two tables (e.g. before and after a daemon restart) start at different random bases
    random.seed()
    starts = {TtlTable(1.0, clock=FakeClock()).add(0) for _ in range(20)}
    assert len(starts) == 20
    assert 0 not in starts


def test_lease_and_reservation_tables_do_not_share_ids() -> None:
    # independent tables draw independent bases, so an id from one is (almost surely) unknown to the other
    leases: TtlTable[str] = TtlTable(30.0, clock=FakeClock())
    reservations: TtlTable[str] = TtlTable(30.0, clock=FakeClock())
    lid, rid = leases.add("l"), reservations.add("r")
    assert lid != rid
    assert rid not in leases and lid not in reservations
