"""Agent hints in a real Engine (kvstore/engine/hints.py over policies/hinted.py): Retain, Release, Demote,
Prefetch, Pin, their outcomes and counters, under LRU and S3-FIFO both.

RAM rig: 4 slots of 1 MiB (engine_helpers' layout), no watermarks, so a block leaves only when a reserve needs
its slot. The policy's clock is the monotonic clock plus `shift[0]`: moving it ahead expires retentions without
sleeping. Disk rig: tests/tiering_rig.py (real DiskStore and mover threads), awaited by polling.
"""

from __future__ import annotations

import errno
import math
import time

import numpy as np
import pytest

from tests.engine_helpers import MiB, NS, put
from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.quotas import TenantQuotas
from kvstore.engine.results import EngineConfig
from kvstore.errors import ConfigError, InvalidRequestError
from kvstore.hint_vocab import HINT_COUNTER_NAMES
from kvstore.policies import make_policy
from kvstore.policies.hinted import HintedPolicy
from kvstore.testing import wait_until
from tests.tiering_rig import NS as DISK_NS
from tests.tiering_rig import rig_fixture, value

make_disk_rig = rig_fixture()
POLICIES = ["lru", "s3fifo"]
KEYS = [b"a", b"b", b"c", b"d"]


def make_engine(policy: str = "lru", quotas: dict[str, int] | None = None, tenant: str = "",
                max_ttl: float = 30.0) -> tuple[Engine, list[float]]:
    shift = [0.0]
    layout = ArenaLayout.for_capacity("x", 4 * MiB, MiB)
    gens = np.zeros(layout.gen_table_bytes // 8, dtype=np.uint64)
    alloc = SlabAllocator(layout.data_offset, layout.data_bytes, MiB)
    pol = HintedPolicy(make_policy(policy), clock=lambda: time.monotonic() + shift[0])
    cfg = EngineConfig(max_block_bytes=MiB, high_watermark=1.0, low_watermark=1.0, hint_max_ttl_s=max_ttl)
    eng = Engine(cfg, layout, gens, alloc, pol, quotas=TenantQuotas(quotas) if quotas else None)
    assert eng.register_namespace(NS, tenant=tenant) is True
    return eng, shift


def held(eng: Engine, keys: list[bytes]) -> list[bytes]:
    return [k for k, p in zip(keys, eng.exists(NS, keys)) if p]


def hint_counters(eng: Engine) -> dict[str, int]:
    return {k: v for k, v in eng.stats().counters.items() if k.startswith("hint_") and v}


@pytest.mark.parametrize("policy", POLICIES)
def test_retained_entries_skip_eviction_while_others_are_eligible(policy: str) -> None:
    eng, _ = make_engine(policy)
    put(eng, KEYS)
    assert eng.hint(NS, [b"a", b"b"], "retain", 10) == ["accepted", "accepted"]
    put(eng, [b"e"])
    assert held(eng, KEYS + [b"e"]) == [b"a", b"b", b"d", b"e"]
    put(eng, [b"f"])
    assert held(eng, KEYS + [b"e", b"f"]) == [b"a", b"b", b"e", b"f"]
    assert hint_counters(eng) == {"hint_retain_accepted": 2}


@pytest.mark.parametrize("policy", POLICIES)
def test_retained_entries_go_under_pressure(policy: str) -> None:
    eng, _ = make_engine(policy)
    put(eng, KEYS)
    assert eng.hint(NS, KEYS, "retain", 10) == ["accepted"] * 4
    put(eng, [b"e"])  # nothing but retained entries: the policy's own choice among them
    assert held(eng, KEYS + [b"e"]) == [b"b", b"c", b"d", b"e"]


@pytest.mark.parametrize("policy", POLICIES)
def test_retention_expires_to_normal(policy: str) -> None:
    eng, shift = make_engine(policy)
    put(eng, KEYS)
    assert eng.hint(NS, [b"a"], "retain", 10) == ["accepted"]
    shift[0] = 10.5
    put(eng, [b"e"])
    assert held(eng, KEYS + [b"e"]) == [b"b", b"c", b"d", b"e"]


@pytest.mark.parametrize("policy", POLICIES)
def test_retain_ttl_is_clipped_to_the_configured_max(policy: str) -> None:
    eng, shift = make_engine(policy, max_ttl=30.0)
    put(eng, KEYS)
    assert eng.hint(NS, [b"a", b"zz"], "retain", 3600) == ["clipped", "missing"]
    shift[0] = 29.0
    put(eng, [b"e"])
    assert held(eng, KEYS + [b"e"]) == [b"a", b"c", b"d", b"e"]  # still retained: b went
    shift[0] = 31.0  # past the clipped deadline (not the hour asked for)
    put(eng, [b"f"])
    # LRU: a is its least recent entry again; S3-FIFO re-inserted a at its small queue's head when it skipped it
    assert held(eng, KEYS + [b"e", b"f"]) == ([b"c", b"d", b"e", b"f"] if policy == "lru" else [b"a", b"d", b"e", b"f"])
    assert hint_counters(eng) == {"hint_retain_clipped": 1, "hint_retain_missing": 1}


@pytest.mark.parametrize("policy", POLICIES)
def test_released_entries_go_first(policy: str) -> None:
    eng, _ = make_engine(policy)
    put(eng, KEYS)
    assert eng.hint(NS, [b"d", b"c", b"nope"], "release") == ["accepted", "accepted", "missing"]
    put(eng, [b"e"])
    assert held(eng, KEYS + [b"e"]) == [b"a", b"b", b"c", b"e"]  # d: released first
    put(eng, [b"f"])
    assert held(eng, KEYS + [b"e", b"f"]) == [b"a", b"b", b"e", b"f"]
    assert eng.hint(NS, [b"a"], "release") == ["accepted"]
    assert eng.hint(NS, [b"a"], "retain", 5) == ["accepted"]  # a later Retain undoes the Release
    put(eng, [b"g"])
    assert held(eng, [b"a", b"b", b"e", b"f", b"g"]) == [b"a", b"e", b"f", b"g"]
    assert hint_counters(eng) == {"hint_release_accepted": 3, "hint_release_missing": 1, "hint_retain_accepted": 1}


def test_bad_hints_are_refused_with_a_clear_message() -> None:
    eng, _ = make_engine()
    put(eng, [b"a"])
    with pytest.raises(InvalidRequestError, match="unknown hint action 'keep': use one of retain, release, demote"):
        eng.hint(NS, [b"a"], "keep", 1)
    with pytest.raises(InvalidRequestError, match="hint retain needs ttl_s > 0"):
        eng.hint(NS, [b"a"], "retain", 0)
    with pytest.raises(InvalidRequestError, match="hint pin needs ttl_s > 0"):
        eng.hint(NS, [b"a"], "PIN")
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidRequestError, match="use a finite number of seconds >= 0"):
            eng.hint(NS, [b"a"], "release", bad)
    assert hint_counters(eng) == {}
    assert eng.hint(NS, [b"a"], "Release") == ["accepted"]  # the engine keeps serving; case does not matter


def test_demote_and_pin_without_disk_or_in_ram() -> None:
    eng, _ = make_engine()
    put(eng, [b"a"])
    assert eng.hint(NS, [b"a", b"x"], "demote") == ["rejected", "missing"]
    assert eng.hint(NS, [b"a", b"x"], "prefetch") == ["accepted", "missing"]
    assert hint_counters(eng) == {"hint_demote_rejected": 1, "hint_demote_missing": 1,
                                  "hint_prefetch_accepted": 1, "hint_prefetch_missing": 1}


@pytest.mark.parametrize("quotas", [None, {"t": 2 * MiB}])
def test_pin_is_bounded_by_the_tenant_budget_and_expires(quotas: dict[str, int] | None) -> None:
    # with quotas: tenant t's 2 MiB quota; without: half the 4 MiB arena. Either way two blocks.
    eng, _ = make_engine(quotas=quotas, tenant="t")
    put(eng, KEYS)
    assert eng.hint(NS, [b"a", b"b", b"c"], "pin", 5) == ["accepted", "accepted", "rejected"]
    assert eng.hint(NS, [b"a", b"x"], "pin", 100) == ["clipped", "missing"]  # extended; counted once
    assert [r.pins for r in eng.describe(NS, KEYS)] == [1, 1, 0, 0]
    put(eng, [b"e", b"f"])  # pinned blocks are never evicted
    assert held(eng, KEYS + [b"e", b"f"]) == [b"a", b"b", b"e", b"f"]
    eng.sweep(now=time.monotonic() + 6)  # b's pin ends; a's was extended to 30 s (the clipped max)
    assert [r.pins for r in eng.describe(NS, [b"a", b"b"])] == [1, 0]
    assert eng.hint(NS, [b"e"], "pin", 5) == ["accepted"]
    assert eng.hint(NS, [b"f"], "pin", 5) == ["rejected"]
    eng.sweep(now=time.monotonic() + 31)
    assert [r.pins for r in eng.describe(NS, [b"a", b"b", b"e", b"f"])] == [0, 0, 0, 0]
    assert eng.hint(NS, [b"a"], "demote") == ["rejected"]  # no disk tier
    assert hint_counters(eng) == {"hint_pin_accepted": 3, "hint_pin_rejected": 2, "hint_pin_clipped": 1,
                                  "hint_pin_missing": 1, "hint_demote_rejected": 1}


def test_counter_names_cover_every_action_and_outcome() -> None:
    eng, _ = make_engine()
    names = [k for k in eng.stats().counters if k.startswith("hint_")]
    assert names == list(HINT_COUNTER_NAMES) and len(names) == 25


def test_demote_writes_then_frees_ram_and_the_block_stays_readable(make_disk_rig) -> None:
    rig = make_disk_rig(admission="never")  # nothing is written at commit: the Demote asks for it
    eng = rig.engine
    rig.put([b"a", b"b"])
    assert eng.hint(DISK_NS, [b"a", b"zz"], "demote") == ["deferred", "missing"]
    rig.wait_written(1)
    wait_until(lambda: [r.tier for r in eng.describe(DISK_NS, [b"a", b"b"])] == ["disk", "ram"],
               what="a's RAM copy dropped after its write")
    assert eng.stats().counters["evicted_to_disk"] == 1
    assert eng.hint(DISK_NS, [b"a"], "demote") == ["accepted"]  # only on disk already
    res = eng.lookup(DISK_NS, [b"a"])
    assert res.present == [True] and rig.read(res, 0) == value(b"a")
    eng.release([res.lease_id])
    assert {k: v for k, v in eng.stats().counters.items() if k.startswith("hint_") and v} == {
        "hint_demote_deferred": 1, "hint_demote_missing": 1, "hint_demote_accepted": 1}


def test_demote_of_a_block_already_on_disk_frees_ram_at_once(make_disk_rig) -> None:
    rig = make_disk_rig()  # admission always: written behind at commit
    eng = rig.engine
    rig.put([b"a"])
    rig.wait_written(1)
    assert eng.hint(DISK_NS, [b"a"], "demote") == ["accepted"]
    assert [r.tier for r in eng.describe(DISK_NS, [b"a"])] == ["disk"]
    assert eng.stats().leased_bytes == 0


def test_a_deferred_demote_writes_at_commit_then_frees_ram(make_disk_rig) -> None:
    rig = make_disk_rig(admission="never")  # no write at commit but the one the Demote asks for
    eng = rig.engine
    r = eng.reserve(DISK_NS, [b"a", b"b"], [len(value(b"a"))] * 2)
    assert eng.hint(DISK_NS, [b"a"], "demote") == ["deferred"]
    for k, off in zip([b"a", b"b"], r.offsets):
        rig.mm[off: off + len(value(k))] = value(k)
    eng.commit(r.reservation_id)
    rig.wait_written(1)
    wait_until(lambda: [i.tier for i in eng.describe(DISK_NS, [b"a", b"b"])] == ["disk", "ram"],
               what="a's RAM copy dropped after the write its deferred Demote queued at commit")
    res = eng.lookup(DISK_NS, [b"a"])
    assert res.present == [True] and rig.read(res, 0) == value(b"a")
    eng.release([res.lease_id])
    assert eng.stats().counters["hints_late_rejected"] == 0


def test_prefetch_brings_a_disk_block_into_ram(make_disk_rig) -> None:
    rig = make_disk_rig()
    eng = rig.engine
    rig.put_disk_only([b"p"])
    rig.put([b"r"])
    assert eng.hint(DISK_NS, [b"p", b"r", b"none"], "prefetch") == ["accepted", "accepted", "missing"]
    wait_until(lambda: [r.tier for r in eng.describe(DISK_NS, [b"p"])] == ["ram+disk"], what="p promoted")
    assert eng.stats().counters["promotions"] == 1
    res = eng.lookup(DISK_NS, [b"p"])
    assert res.tiers == [1] and rig.read(res, 0) == value(b"p")
    eng.release([res.lease_id])
    assert eng.hint(DISK_NS, [b"p"], "retain", 5) == ["accepted"]


def test_hint_max_ttl_rule_names_the_setting() -> None:
    for bad in (0.0, -1.0, 86401.0):
        with pytest.raises(ConfigError, match=rf"invalid config: hint_max_ttl_s={bad}: use a number of seconds"):
            EngineConfig(max_block_bytes=MiB, hint_max_ttl_s=bad)
    assert EngineConfig(max_block_bytes=MiB).hint_max_ttl_s == 600.0


# -- hints on blocks still being written (RESERVED: their Commit pending) --------------------------------------

def late_counters(eng: Engine) -> dict[str, int]:
    return {k: v for k, v in eng.stats().counters.items() if (k.startswith("hint_") or k == "hints_late_rejected")
            and v}


@pytest.mark.parametrize("policy", POLICIES)
def test_hints_on_blocks_being_written_apply_at_their_commit(policy: str) -> None:
    # The connector's case: a turn's hints reach the daemon before the Commit of the turn's last blocks.
    eng, _ = make_engine(policy)
    put(eng, [b"a", b"b"])
    r = eng.reserve(NS, [b"c", b"d"], [MiB, MiB])
    assert eng.hint(NS, [b"c", b"a"], "retain", 10) == ["deferred", "accepted"]
    assert eng.hint(NS, [b"c"], "pin", 10) == ["deferred"]
    assert eng.hint(NS, [b"d"], "release") == ["deferred"]
    assert eng.hint(NS, [b"c", b"zz"], "prefetch") == ["accepted", "missing"]  # it will be in RAM; nothing to do
    assert eng.hint(NS, [b"d"], "demote") == ["rejected"]  # no disk tier: refused at once, not deferred
    assert eng._hints.waiting() == 2 and [i.pins for i in eng.describe(NS, [b"a", b"b"])] == [0, 0]
    assert eng.commit(r.reservation_id) == 2
    assert eng._hints.waiting() == 0
    assert [i.pins for i in eng.describe(NS, [b"a", b"b", b"c", b"d"])] == [0, 0, 1, 0]
    put(eng, [b"e"])  # d was released at its commit: first to go
    assert held(eng, [b"a", b"b", b"c", b"d", b"e"]) == [b"a", b"b", b"c", b"e"]
    put(eng, [b"f"])  # a and c are retained (c pinned too): b, then e
    assert held(eng, [b"a", b"b", b"c", b"e", b"f"]) == [b"a", b"c", b"e", b"f"]
    assert late_counters(eng) == {"hint_retain_deferred": 1, "hint_retain_accepted": 1, "hint_pin_deferred": 1,
                                  "hint_release_deferred": 1, "hint_prefetch_accepted": 1,
                                  "hint_prefetch_missing": 1, "hint_demote_rejected": 1}


@pytest.mark.parametrize("first,last,kept", [
    ("release", "retain", [b"b", b"c", b"x", b"y"]),   # x retained: the least recent other block (a) goes
    ("retain", "release", [b"a", b"b", b"c", b"y"])])  # x released: it goes first
def test_the_latest_deferred_hint_wins(first: str, last: str, kept: list[bytes]) -> None:
    eng, _ = make_engine()
    put(eng, [b"a", b"b", b"c"])
    r = eng.reserve(NS, [b"x"], [MiB])
    assert eng.hint(NS, [b"x"], first, 10) == ["deferred"]
    assert eng.hint(NS, [b"x"], last, 10) == ["deferred"]
    eng.commit(r.reservation_id)
    put(eng, [b"y"])
    assert held(eng, [b"a", b"b", b"c", b"x", b"y"]) == kept


def test_hints_of_an_aborted_or_expired_reservation_are_dropped() -> None:
    eng, _ = make_engine()
    r = eng.reserve(NS, [b"x"], [MiB])
    assert eng.hint(NS, [b"x"], "pin", 10) == ["deferred"]
    eng.abort(r.reservation_id)
    assert eng._hints.waiting() == 0
    put(eng, [b"x"])  # the same key written again: the old reservation's pin does not come back
    assert [i.pins for i in eng.describe(NS, [b"x"])] == [0]
    r = eng.reserve(NS, [b"y"], [MiB])
    assert eng.hint(NS, [b"y"], "pin", 10) == ["deferred"]
    later = time.monotonic() + eng.config.reservation_ttl_s + eng.config.quarantine_s + 1
    eng.sweep(now=later - eng.config.quarantine_s)  # expired: quarantined
    eng.sweep(now=later)  # its slot freed after the quarantine, and its hints with it
    assert eng._hints.waiting() == 0
    put(eng, [b"y"])
    assert [i.pins for i in eng.describe(NS, [b"y"])] == [0]


def test_a_deferred_pin_beyond_the_budget_is_counted_late() -> None:
    eng, _ = make_engine(tenant="t")  # budget: half the 4 MiB arena, two blocks
    put(eng, [b"a"])
    r = eng.reserve(NS, [b"b", b"c"], [MiB, MiB])
    assert eng.hint(NS, [b"b", b"c"], "pin", 10) == ["deferred", "deferred"]
    assert eng.hint(NS, [b"a"], "pin", 10) == ["accepted"]  # a takes one of the two blocks of budget first
    eng.commit(r.reservation_id)
    assert [i.pins for i in eng.describe(NS, [b"a", b"b", b"c"])] == [1, 1, 0]
    assert late_counters(eng) == {"hint_pin_deferred": 2, "hint_pin_accepted": 1, "hints_late_rejected": 1}
    assert eng._hints.pinned_bytes("t") == 2 * MiB  # a and b: c's refused pin holds nothing


def test_hints_on_a_block_being_promoted_apply_when_it_lands(make_disk_rig) -> None:
    # An agent's Prefetch when its tool returns, then a Retain and a Pin: they meet the promotion in flight.
    rig = make_disk_rig()
    eng = rig.engine
    rig.put_disk_only([b"p", b"q"])
    rig.io.armed = "pread"  # hold the promoter's reads
    assert eng.hint(DISK_NS, [b"p", b"q"], "prefetch") == ["accepted", "accepted"]
    assert rig.io.entered.wait(10)
    assert eng.hint(DISK_NS, [b"p"], "retain", 60) == ["deferred"]
    assert eng.hint(DISK_NS, [b"p"], "pin", 60) == ["deferred"]
    assert eng.hint(DISK_NS, [b"q"], "pin", 60) == ["deferred"]
    assert eng._hints.waiting() == 2
    rig.io.inject("pread", errno.EIO, times=1)  # one of the two reads fails: its hints go with its slot
    rig.io.armed = ""
    rig.io.gate.set()
    wait_until(lambda: eng.stats().counters["promotions"] == 2 and eng._hints.waiting() == 0
               and eng.stats().counters["promotion_failures"] == 1, what="both promotions ended")
    infos = eng.describe(DISK_NS, [b"p", b"q"])
    # the read error dropped its block (a miss from now on); the one that landed carries its deferred pin
    assert [(i.tier, i.pins) for i in infos] == [("ram+disk", 1)] and sorted(eng.exists(DISK_NS, [b"p", b"q"])) == [
        False, True]
    assert late_counters(eng) == {"hint_prefetch_accepted": 2, "hint_retain_deferred": 1, "hint_pin_deferred": 2}
