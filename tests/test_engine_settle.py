"""Work a call leaves for after its reply (kvstore/engine/engine_lock.py): a Commit or Store with settle_later
answers before its watermark eviction, and that eviction runs at Engine.settle or when any other call takes the
lock, whichever comes first; no caller ever sees the state in between.

Rig: 64 slabs of 64 KiB, 64 KiB blocks; high watermark 0.95 (> 60.8 blocks), low 0.90 (down to 57 * 64 KiB).
"""

from __future__ import annotations

import logging
import threading

import pytest

from kvstore.engine.engine_lock import EngineLock
from tests.engine_helpers import NS, KiB, MiB, make_rig, present, put

BLOCK = 64 * KiB
KEYS = [b"k%02d" % i for i in range(64)]


def test_deferred_work_runs_once_at_the_next_taking_of_the_lock() -> None:
    lock, ran = EngineLock(), []
    with lock:
        lock.defer(lambda: ran.append("a"))
        work = lambda: ran.append("b")  # noqa: E731
        lock.defer(work)
        lock.defer(work)  # the same work twice: once
        assert ran == [] and lock.pending
    assert ran == [] and lock.pending  # leaving the lock runs nothing
    with lock:
        assert ran == ["a", "b"] and not lock.pending
    with lock:
        assert ran == ["a", "b"]


def test_deferred_work_that_fails_is_logged_and_the_next_holder_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    lock, ran = EngineLock(), []

    def broken() -> None:
        raise RuntimeError("boom")
    with lock:
        lock.defer(broken)
        lock.defer(lambda: ran.append("after"))
    with caplog.at_level(logging.ERROR, logger="kvstore.engine.engine_lock"):
        with lock:
            ran.append("holder")
    assert ran == ["after", "holder"]
    assert [str(r.exc_info[1]) for r in caplog.records if r.exc_info] == ["boom"]
    assert not lock.pending
    done = threading.Event()  # the lock was released: another thread takes it

    def take() -> None:
        with lock:
            done.set()
    t = threading.Thread(target=take)
    t.start()
    t.join(5)
    assert done.is_set()


def test_a_commit_settled_later_evicts_at_settle_exactly_as_a_commit_that_evicts_at_once() -> None:
    now_rig, later_rig = make_rig(data_bytes=4 * MiB, max_block=BLOCK), make_rig(data_bytes=4 * MiB, max_block=BLOCK)
    for rig in (now_rig, later_rig):
        put(rig.engine, KEYS[:60], size=BLOCK)
    put(now_rig.engine, [KEYS[60]], size=BLOCK)
    r = later_rig.engine.reserve(NS, [KEYS[60]], [BLOCK])
    assert later_rig.engine.commit(r.reservation_id, settle_later=True) == 1
    # answered: the block is committed and visible, nothing evicted yet (read without taking the lock)
    eng = later_rig.engine
    assert later_rig.alloc.allocated_bytes == 61 * BLOCK and eng.counters.snapshot().get("evictions", 0) == 0
    assert eng._lock.pending
    eng.settle()
    assert not eng._lock.pending
    for rig in (now_rig, later_rig):
        st = rig.engine.stats()
        assert (st.blocks, st.allocated_bytes, st.counters["evictions"]) == (57, 57 * BLOCK, 4)
        assert present(rig.engine, KEYS[:5]) == [False] * 4 + [True]
    eng.settle()  # nothing left: a no-op
    assert eng.stats().counters["evictions"] == 4


@pytest.mark.parametrize("first_caller", ["stats", "exists", "reserve", "sweep"])
def test_any_call_that_takes_the_lock_first_runs_the_eviction_before_its_own_work(first_caller: str) -> None:
    rig = make_rig(data_bytes=4 * MiB, max_block=BLOCK)
    eng = rig.engine
    put(eng, KEYS[:60], size=BLOCK)
    _, slots = eng.spare(1, BLOCK, 1)
    res = eng.store(1, NS, [KEYS[60]], [BLOCK], slots, settle_later=True)
    assert res.stored == 1 and res.refill[0] not in (0, slots[0])
    assert rig.alloc.allocated_bytes == 62 * BLOCK  # 61 blocks + the new spare slot: above the high watermark
    if first_caller == "stats":
        st = eng.stats()
        assert (st.blocks, st.counters["evictions"]) == (56, 5)  # down to 57 slots: 56 blocks + 1 spare
    elif first_caller == "exists":
        assert eng.exists(NS, KEYS[:6]) == [False] * 5 + [True]
    elif first_caller == "reserve":
        r = eng.reserve(NS, [b"new"], [BLOCK])  # takes a slot the eviction freed, not an allocation-time victim
        assert eng.counters.snapshot()["evictions"] == 5
        eng.abort(r.reservation_id)
    else:
        eng.sweep()
    assert not eng._lock.pending
    assert rig.alloc.allocated_bytes == 57 * BLOCK and present(eng, KEYS[4:6] + [KEYS[60]]) == [False, True, True]
