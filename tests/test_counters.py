"""kvstore.counters.CounterSet: the one counters implementation, as the engine and the peer tier declare it."""

from __future__ import annotations

import threading

import pytest

from kvstore.counters import CounterSet
from kvstore.engine.counters import COUNTER_NAMES, Counters
from kvstore.peer.counters import COUNTER_HELP, PeerCounters


def test_each_set_has_exactly_its_names_starting_at_zero() -> None:
    assert Counters().snapshot() == dict.fromkeys(COUNTER_NAMES, 0)
    assert list(Counters().snapshot()) == list(COUNTER_NAMES)  # Stats and metrics read them in this order
    assert PeerCounters().snapshot() == dict.fromkeys(COUNTER_HELP, 0)


def test_a_misspelt_name_is_an_attribute_error_in_every_set() -> None:
    engine, peer = Counters(), PeerCounters()
    with pytest.raises(AttributeError, match="evictons"):
        engine.evictons += 1  # the typo under test
    with pytest.raises(AttributeError, match="erors"):
        peer.add("erors")
    with pytest.raises(AttributeError, match="erors"):
        peer.add("erors", 0)
    with pytest.raises(AttributeError, match="fetch_call"):
        peer.get("fetch_call")
    assert "evictons" not in engine.snapshot() and "erors" not in peer.snapshot()


def test_engine_counters_are_bumped_in_place_and_by_add() -> None:
    c = Counters()
    c.evictions += 2
    c.add("evictions", 3)
    c.add("hit_keys_disk")
    assert (c.get("evictions"), c.snapshot()["hit_keys_disk"], c.snapshot()["hit_keys_ram"]) == (5, 1, 0)


def test_a_locked_set_counts_every_add_from_many_threads() -> None:
    c = PeerCounters()
    barrier = threading.Barrier(4)

    def bump() -> None:
        barrier.wait()
        for _ in range(5000):
            c.add("fetch_keys", 2)
            c.add("errors")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (c.get("fetch_keys"), c.get("errors")) == (40000, 20000)


def test_a_new_set_is_one_slots_line() -> None:
    class Tiny(CounterSet):
        __slots__ = ("a", "b")
        LOCKED = True

    t = Tiny()
    t.add("b", 4)
    assert (Tiny.NAMES, t.snapshot()) == (("a", "b"), {"a": 0, "b": 4})
    with pytest.raises(AttributeError):
        t.c = 1  # slots: no new names
