"""Spare slots and Store (kvstore/engine/spares.py, writes.py) on the real engine parts: exact slots, counts,
generations and refusals. A Store either applies whole or changes nothing; the daemon-level tests are in
tests/test_spare_puts.py.

Rig: 16 MiB of data in 1 MiB slabs, so spare slots may take 2 MiB (1/8) in all; no watermarks unless a test
sets them.
"""

from __future__ import annotations

import pytest

from kvstore.engine.spares import MAX_PER_OWNER
from kvstore.errors import BatchTooLargeError, InvalidRequestError
from tests.engine_helpers import NO_WATERMARKS, NS, KiB, MiB, later, make_rig, present, put
from kvstore.vocab import ReserveOutcome

SLOT = 256 * KiB
A, B = 1, 2  # two connections


def rig(**cfg: float | int):  # type: ignore[no-untyped-def]
    return make_rig(data_bytes=16 * MiB, max_block=MiB, **{**NO_WATERMARKS, **cfg})


def test_spare_slots_are_granted_all_or_none_and_replaced_on_asking_again() -> None:
    r = rig()
    cls, got = r.engine.spare(A, SLOT, 4)
    assert cls == SLOT and len(set(got)) == 4 and r.alloc.allocated_bytes == 4 * SLOT
    gens = [r.gen_at(off) for off in got]
    assert r.engine.spare(A, SLOT, 9) == (SLOT, [])   # 9 x 256 KiB > 2 MiB: none, and the 4 are gone
    assert r.alloc.allocated_bytes == 0 and [r.gen_at(off) for off in got] == [g + 1 for g in gens]
    assert len(r.engine.spare(A, SLOT, 8)[1]) == 8     # exactly the 1/8 share
    assert r.engine.spare(B, SLOT, 1) == (SLOT, [])   # the share is spent: B gets none
    assert len(r.engine.spare(A, MiB, 1)[1]) == 1      # A's 8 are freed first: one 1 MiB slot fits the share
    assert r.alloc.allocated_bytes == MiB
    assert len(r.engine.spare(A, 2 * SLOT, 4)[1]) == 4  # it replaces the 1 MiB one: 4 x 512 KiB = 2 MiB fits
    assert r.alloc.allocated_bytes == 2 * MiB
    with pytest.raises(BatchTooLargeError, match=f"limit of {MAX_PER_OWNER}"):
        r.engine.spare(A, SLOT, MAX_PER_OWNER + 1)
    with pytest.raises(InvalidRequestError):
        r.engine.spare(A, 0, 1)
    with pytest.raises(InvalidRequestError):
        r.engine.spare(A, 2 * MiB, 1)  # over max_block_bytes


def test_a_store_binds_and_commits_new_keys_and_refills_the_slots_it_used() -> None:
    r = rig()
    _, slots = r.engine.spare(A, SLOT, 3)
    before = dict(r.engine.counters.snapshot())
    res = r.engine.store(A, NS, [b"k0", b"k1", b"k2"], [SLOT, SLOT - 1, SLOT - 4096], slots)
    assert res.outcomes == [ReserveOutcome.RESERVED] * 3 and res.stored == 3
    assert present(r.engine, [b"k0", b"k1", b"k2"]) == [True] * 3
    looked = r.engine.lookup(NS, [b"k0", b"k1", b"k2"], lease=False)
    assert looked.offsets == slots and looked.sizes == [SLOT, SLOT - 1, SLOT - 4096]
    assert len(set(res.refill)) == 3 and not set(res.refill) & set(slots) and 0 not in res.refill
    assert sorted(r.engine._spares.owned(A)) == sorted(res.refill)
    after = r.engine.counters.snapshot()
    assert {k: after[k] - before.get(k, 0) for k in ("reserve_calls", "reserved_blocks", "committed_blocks",
                                                     "committed_bytes")} == {
        "reserve_calls": 1, "reserved_blocks": 3, "committed_blocks": 3, "committed_bytes": 3 * SLOT - 4097}


def test_a_present_key_keeps_its_slot_spare() -> None:
    r = rig()
    put(r.engine, [b"old"], size=SLOT)
    _, slots = r.engine.spare(A, SLOT, 2)
    res = r.engine.store(A, NS, [b"old", b"new"], [SLOT, SLOT], slots)
    assert res.outcomes == [ReserveOutcome.ALREADY_PRESENT, ReserveOutcome.RESERVED] and res.stored == 1
    assert res.refill[0] == 0 and res.refill[1] not in (0, *slots)
    assert sorted(r.engine._spares.owned(A)) == sorted([slots[0], res.refill[1]])


def test_a_refused_store_changes_nothing() -> None:
    r = rig()
    _, mine = r.engine.spare(A, SLOT, 2)
    _, theirs = r.engine.spare(B, SLOT, 1)
    cases = {
        "not a spare slot of this connection": (A, [b"x"], [SLOT], theirs),
        f"offset {theirs[0]} is not a spare slot": (A, [b"x", b"y"], [SLOT, SLOT], [mine[0], theirs[0]]),
        "named twice": (A, [b"x", b"y"], [SLOT, SLOT], [mine[0], mine[0]]),
        "does not fit the size class": (A, [b"x"], [SLOT // 2], mine[:1]),
        "1 slots for 2 blocks": (A, [b"x", b"y"], [SLOT, SLOT], mine[:1]),
    }
    allocated = r.alloc.allocated_bytes
    for message, (owner, keys, sizes, offsets) in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            r.engine.store(owner, NS, keys, sizes, offsets)
    assert present(r.engine, [b"x", b"y"]) == [False, False]
    assert r.engine._spares.owned(A) == {off: SLOT for off in mine}
    assert r.engine._spares.owned(B) == {theirs[0]: SLOT}
    assert r.alloc.allocated_bytes == allocated and r.engine.counters.snapshot()["reserve_calls"] == 0
    # a size over max_block_bytes: the engine's own size check, before any slot is looked at
    with pytest.raises(InvalidRequestError):
        r.engine.store(A, NS, [b"x"], [MiB + 1], mine[:1])


def test_with_isolated_tenants_a_slot_binds_only_in_its_tenants_namespaces() -> None:
    """A slot lives in the memory file of the tenant it was granted for: a Store of another tenant's namespace
    naming it is refused whole (its bytes would sit in memory that tenant's clients map), its own tenant's
    works."""
    r = rig(isolate_tenants=True)
    assert r.engine.register_namespace("t1/ns", tenant="t1") and r.engine.register_namespace("t2/ns", tenant="t2")
    _, mine = r.engine.spare(A, SLOT, 2, "t1")
    with pytest.raises(InvalidRequestError, match=f"spare slot {mine[0]} lives in another tenant's memory"):
        r.engine.store(A, "t2/ns", [b"x", b"y"], [SLOT, SLOT], mine)
    assert r.engine.exists("t2/ns", [b"x", b"y"]) == [False, False]
    assert r.engine._spares.owned(A) == {off: SLOT for off in mine}
    res = r.engine.store(A, "t1/ns", [b"x", b"y"], [SLOT, SLOT], mine)
    assert res.stored == 2 and r.engine.exists("t1/ns", [b"x", b"y"]) == [True, True]


def test_a_store_of_mixed_sizes_refills_each_class_in_its_own_slots() -> None:
    """Blocks of two size classes in one Store: each used slot is refilled with a slot of its block's class."""
    r = rig()
    _, small = r.engine.spare(A, SLOT, 2)
    r.engine._spares.grant(A, 2 * SLOT, 1, "")
    big = [off for off, cls in r.engine._spares.owned(A).items() if cls == 2 * SLOT]
    res = r.engine.store(A, NS, [b"s0", b"b0", b"s1"], [SLOT, 2 * SLOT, SLOT - 1], [small[0], big[0], small[1]])
    assert res.stored == 3 and 0 not in res.refill
    owned = r.engine._spares.owned(A)
    assert [owned[off] for off in res.refill] == [SLOT, 2 * SLOT, SLOT] and len(owned) == 3


def test_a_closed_connections_slots_wait_out_the_quarantine_then_free() -> None:
    r = rig(quarantine_s=5.0)
    _, slots = r.engine.spare(A, SLOT, 3)
    gens = [r.gen_at(off) for off in slots]
    assert r.engine.drop_spares(A) == 3
    r.engine.sweep(now=later(4.0))
    assert r.alloc.allocated_bytes == 3 * SLOT  # a thread of that client may still copy into them
    with pytest.raises(InvalidRequestError, match="not a spare slot"):
        r.engine.store(A, NS, [b"late"], [SLOT], slots[:1])
    r.engine.sweep(now=later(6.0))
    assert r.alloc.allocated_bytes == 0 and [r.gen_at(off) for off in slots] == [g + 1 for g in gens]
    assert r.engine._spares.bytes == 0 and r.engine._spares.slots == 0
