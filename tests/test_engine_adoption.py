"""An engine's state handed to a fresh engine over a real arena: what a hand-over restart keeps, exactly.

Script of each test: an old engine over a memfd arena does some work, exports its live state; a new engine maps
the same files (a successor's view), adopts the verified journal entries and that state; then the new engine
is asked what a client would ask. Exact values throughout.
"""

from __future__ import annotations

import os
import time

import numpy as np

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.backing import ArenaBacking
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.adoption import LiveState
from kvstore.engine.engine import Engine
from kvstore.engine.results import EngineConfig
from kvstore.errors import UnknownReservationError
from kvstore.hint_vocab import HintAction
from kvstore.policies import make_policy
from kvstore.server.handover.inherit import open_arena, verified_entries
from kvstore.vocab import Tier

MiB = 1 << 20
NS = "m@1/adopt"
BLOCK = 256 * 1024
CFG = dict(max_block_bytes=MiB, high_watermark=1.0, low_watermark=1.0)


def _engine(arena: ArenaBacking, namespaces: dict | None = None) -> Engine:
    lay = arena.layout
    alloc = SlabAllocator(lay.data_offset, lay.data_bytes, MiB)
    eng = Engine(EngineConfig(**CFG), lay, arena.generations, alloc, make_policy("lru"), namespaces=namespaces)
    eng.attach_journal(arena.journal, arena.generations)
    return eng


def _old(n: int = 8) -> tuple[ArenaBacking, Engine, list[bytes]]:
    arena = ArenaBacking(ArenaLayout.for_capacity("adopt-test", 8 * MiB, MiB), lock="off")
    eng = _engine(arena)
    eng.register_namespace(NS)
    keys = [b"key-%02d" % i for i in range(n)]
    r = eng.reserve(NS, keys, [BLOCK] * n)
    for i, off in enumerate(r.offsets):
        arena.view[off: off + BLOCK] = i + 1
    eng.commit(r.reservation_id)
    return arena, eng, keys


def _hand_over(arena: ArenaBacking, eng: Engine) -> tuple[ArenaBacking, Engine, LiveState]:
    """What a hand-over does between the two engines (handover_host.py freeze, main.py Daemon._adopt)."""
    eng.sync_journal(arena.view, hash_missing=True, everything=True)
    eng.freeze()
    eng.freeze_journal(arena.view)
    live = eng.export_live()
    files = {d: os.dup(f.fd) for d, f in arena.files().items()}
    succ, why = open_arena(arena.layout, os.dup(arena.journal.fd), files, isolated=False, lock="off")
    assert succ is not None, why
    entries, _, namespaces, _ = verified_entries(succ)
    new = _engine(succ, namespaces)
    domains = [succ.domain_of_slab(s) for s in range(succ.layout.n_slabs)]
    report, gone = new.adopt(entries, live, new.lost_namespaces, domains, tables_kept=False)
    assert gone == [] and report.dropped == {}
    return succ, new, live


def test_blocks_leases_and_reservations_carry_over() -> None:
    arena, eng, keys = _old()
    lease = eng.lookup(NS, keys[:2])                                   # a load in flight over the hand-over
    open_r = eng.reserve(NS, [b"late-1", b"late-2"], [BLOCK, BLOCK])   # a save in flight
    for off in open_r.offsets:
        arena.view[off: off + BLOCK] = 0xAB
    succ, new, live = _hand_over(arena, eng)
    assert len(live.leases) == 1 and len(live.reservations) == 1
    hits = new.lookup(NS, keys, lease=False)
    assert hits.num_prefix == 8 and hits.tiers == [int(Tier.RAM)] * 8
    # the save finishes in the successor under the reservation id the old daemon gave
    assert new.commit(open_r.reservation_id) == 2
    got = new.lookup(NS, [b"late-1", b"late-2"])
    assert [int(succ.view[o]) for o in got.offsets] == [0xAB, 0xAB]
    # the load's lease is the successor's to release, by the same id
    assert new.release([lease.lease_id]) == 1
    assert new.release([lease.lease_id]) == 0
    # ids handed out next never name one of the old daemon's
    assert new.reserve(NS, [b"next"], [BLOCK]).reservation_id > open_r.reservation_id


def test_a_leased_block_deleted_before_the_hand_over_is_freed_at_its_release() -> None:
    arena, eng, keys = _old()
    lease = eng.lookup(NS, [keys[0]])
    assert eng.delete(NS, [keys[0]]) == 1                              # DOOMED: hidden, its slot still read
    gen_before = int(arena.generations[arena.layout.generation_index(lease.offsets[0])])
    succ, new, live = _hand_over(arena, eng)
    assert len(live.doomed) == 1
    assert new.exists(NS, [keys[0]]) == [False]
    assert int(succ.generations[succ.layout.generation_index(lease.offsets[0])]) == gen_before
    assert new.release([lease.lease_id]) == 1                          # last holder: now freed, generation bumped
    assert int(succ.generations[succ.layout.generation_index(lease.offsets[0])]) == gen_before + 1


def test_pins_hint_pins_and_eviction_order_carry_over() -> None:
    arena, eng, keys = _old()
    assert eng.pin(NS, [keys[0]], +1) == 1
    assert eng.hint(NS, [keys[1]], HintAction.PIN, ttl_s=60.0) == ["accepted"]
    eng.lookup(NS, [keys[2]], lease=False)                              # keys[2] is now the most recent
    eng.sweep()
    _, new, live = _hand_over(arena, eng)
    assert list(live.pins.values()) == [1] and len(live.hint_pins) == 1  # the Pin RPC's, the hint's
    # fill the arena: the successor evicts in the old daemon's LRU order, never a pinned block
    more = [b"fill-%02d" % i for i in range(29)]  # 32 slots: 24 fill them, 5 more evict 5
    for k in more:
        r = new.reserve(NS, [k], [BLOCK])
        new.commit(r.reservation_id)
    present = new.exists(NS, keys)
    assert present[0] and present[1]                                    # pinned, and pinned by a hint
    assert present[2]                                                   # the most recent survived longest
    assert present[3:] == [False] * 5
    # the hint pin still expires: 60 s later it is an ordinary block
    new.sweep(now=time.monotonic() + 61)
    assert new.hint(NS, [keys[1]], HintAction.RELEASE) == ["accepted"]


def test_an_entry_in_another_tenants_file_is_not_adopted() -> None:
    # isolated arena: tenant a's block, then the journal claims its namespace belongs to tenant b
    arena = ArenaBacking(ArenaLayout.for_capacity("adopt-iso", 8 * MiB, MiB), isolated=True, lock="off")
    lay = arena.layout
    alloc = SlabAllocator(lay.data_offset, lay.data_bytes, MiB, bind=arena.bind)
    eng = Engine(EngineConfig(**CFG, isolate_tenants=True), lay, arena.generations, alloc, make_policy("lru"))
    eng.attach_journal(arena.journal, arena.generations)
    eng.register_namespace("a@1/x", tenant="a")
    eng.register_namespace("b@1/x", tenant="b")
    for ns in ("a@1/x", "b@1/x"):
        r = eng.reserve(ns, [b"k"], [BLOCK])
        arena.view[r.offsets[0]: r.offsets[0] + BLOCK] = 7
        eng.commit(r.reservation_id)
    eng.sync_journal(arena.view, hash_missing=True)
    arena.journal.set_namespace(0, {"name": "a@1/x", "model": "", "layout_digest": "", "tenant": "b",
                                    "disk_codec": "none", "tokens_per_block": 0, "recovered": False})
    files = {d: os.dup(f.fd) for d, f in arena.files().items()}
    succ, why = open_arena(lay, os.dup(arena.journal.fd), files, isolated=True, lock="off")
    assert succ is not None, why
    entries, _, namespaces, _ = verified_entries(succ)
    alloc2 = SlabAllocator(lay.data_offset, lay.data_bytes, MiB, bind=succ.bind)
    new = Engine(EngineConfig(**CFG, isolate_tenants=True), lay, succ.generations, alloc2, make_policy("lru"),
                 namespaces=namespaces)
    report, gone = new.adopt(entries, None, new.lost_namespaces,
                             [succ.domain_of_slab(s) for s in range(lay.n_slabs)], tables_kept=False)
    assert report.blocks == 1 and report.dropped == {"tenant_file": 1} and gone == [(0, b"k")]
    assert new.exists("a@1/x", [b"k"]) == [False] and new.exists("b@1/x", [b"k"]) == [True]


def test_after_a_crash_the_journal_alone_is_enough() -> None:
    # no live state: blocks only; a reservation open at the crash is simply gone
    arena, eng, keys = _old()
    open_r = eng.reserve(NS, [b"unfinished"], [BLOCK])
    eng.sync_journal(arena.view, hash_missing=True)
    files = {d: os.dup(f.fd) for d, f in arena.files().items()}
    succ, _ = open_arena(arena.layout, os.dup(arena.journal.fd), files, isolated=False, lock="off")
    assert succ is not None
    entries, _, namespaces, _ = verified_entries(succ)
    new = _engine(succ, namespaces)
    report, _ = new.adopt(entries, None, set(), [""] * succ.layout.n_slabs, tables_kept=False)
    assert report.blocks == 8
    got = new.lookup(NS, keys)
    assert [int(succ.view[o]) for o in got.offsets] == list(range(1, 9))
    try:
        new.commit(open_r.reservation_id)
        raise AssertionError("a reservation of a crashed daemon committed")
    except UnknownReservationError:
        pass
    # its slot is free again: the arena holds exactly the 8 adopted blocks
    assert new.stats().allocated_bytes == 8 * BLOCK
    assert np.all(new.exists(NS, [b"unfinished"]) == [False])
