"""Tests of the S3-FIFO RAM tier of bench.replay's exact simulator (sim_policy.PolicyTier: the daemon's own
S3FIFOPolicy driven in the engine's event order): exact victim sequences on hand-made scripts (the small FIFO's
one-hit wonders, the ghost sending a returning key to M, entries a call holds re-inserted at their queue's head,
promotions that allocate before any of them is inserted, the landing order), and store == simulator through a
real daemon with policy s3fifo, RAM alone and RAM + disk (where the promoter threads' landing order is read from
the daemon's event stream, landing.py).
"""

from __future__ import annotations

import pytest

from bench.replay.agentx import AgentXParams, generate
from bench.replay.landing import replay_observed
from bench.replay.replayer import replay
from bench.replay.run import _tier_checks
from bench.replay.hints import simulate_hinted
from bench.replay.sim import CacheSim, LRUTier, PolicyTier, SegmentLog, simulate
from bench.replay.sim_policy import HintedPolicyTier
from bench.replay.tiers import StoreSpec
from bench.replay.verdict import mismatches

K = [f"k{i}".encode() for i in range(12)]
SMALL = AgentXParams(sessions=6, scale=0.05, seed=1)


def _queues(t: PolicyTier) -> tuple[int, int, int]:
    p = t.policy.inner  # the S3FIFOPolicy inside the engine's hint wrapper
    return p.small_len, p.main_len, p.ghost_len  # type: ignore[attr-defined]  # an S3FIFOPolicy's metrics


# -- the tier on scripts ---------------------------------------------------------------------------------------

def test_small_fifo_evicts_one_hit_wonders_and_the_ghost_sends_them_back_to_main() -> None:
    t = PolicyTier("ram", 4)
    assert t.admit(K[:4], ()) == (True, [])
    t.touch([K[0]])  # deferred like the daemon's read buffer, applied before the next victim choice
    # S (tail first) k0 k1 k2 k3: k0 was hit, so it moves to M; k1 goes and its fingerprint enters the ghost
    assert t.admit([K[4]], ()) == (True, [K[1]]) and _queues(t) == (3, 1, 1)
    assert t.admit([K[5]], ()) == (True, [K[2]]) and _queues(t) == (3, 1, 2)
    # k1 comes back: a ghost hit, so it is inserted into M, not S
    assert t.admit([K[1]], ()) == (True, [K[3]]) and _queues(t) == (2, 2, 2)
    # the ghost holds at most the tracked entries at each eviction: 2 left after the second victim here
    assert t.admit(K[6:8], ()) == (True, [K[4], K[5]]) and _queues(t) == (2, 2, 2)
    assert K[1] in t and K[0] in t and len(t) == 4


def test_entries_a_call_holds_go_back_to_the_head_of_their_queue() -> None:
    # LRU leaves a held entry in place (it is next again); S3-FIFO re-inserts it at its queue's head
    s3, lru = PolicyTier("ram", 3), LRUTier("ram", 3)
    for t in (s3, lru):
        t.admit(K[:3], ())
    assert s3.admit([K[3]], [K[0]]) == (True, [K[1]]) == lru.admit([K[3]], [K[0]])
    assert s3.admit([K[4]], ()) == (True, [K[2]])
    assert lru.admit([K[4]], ()) == (True, [K[0]])


def test_put_is_all_or_nothing_and_keeps_its_victims_evicted() -> None:
    t = PolicyTier("ram", 3)
    t.admit(K[:3], ())
    assert t.admit(K[3:6], [K[1], K[2]]) == (False, [K[0]])  # two slots short: k0 went, nothing stored
    assert len(t) == 2 and K[3] not in t


def test_promotions_allocate_before_any_lands_and_land_in_the_given_order() -> None:
    # Both slots are freed before either promoted block joins the policy: at the second eviction nothing is
    # tracked, so the ghost bound is 0 and it forgets k0 and k1 (inserting each at once would keep k1 there).
    t = PolicyTier("ram", 2)
    t.admit(K[:2], ())
    assert [t.take_victim(()), t.take_victim(())] == [K[0], K[1]]  # two promotions' slots, before either lands
    t.insert_landed([K[2], K[3]])
    assert _queues(t) == (2, 0, 0)
    # The landing order is the order of the S FIFO: reversed, k3 is the older entry and goes first.
    for landing, first in ((None, K[4]), (lambda got: got[::-1], K[5])):
        t = PolicyTier("ram", 4)
        t.admit(K[:2], ())
        assert t.free_slots() == 2  # two free slots: no victim
        t.insert_landed(landing([K[4], K[5]]) if landing is not None else [K[4], K[5]])
        assert t.admit(K[6:9], ()) == (True, [K[0], K[1], first])


def test_a_promotion_with_no_slot_fails_and_cuts_the_prefix() -> None:
    # RAM of 2 holding the probe's two RAM hits: nothing is evictable for the disk block between them
    ram, disk = PolicyTier("ram", 2), SegmentLog("disk", 2, 1 << 20, 32768)
    sim = CacheSim([ram, disk])
    assert sim.put(K[:2]) == 2 and sim.put(K[2:3]) == 1  # k0 left RAM (a one-hit wonder); its disk copy stays
    assert disk.written == 3 and list(ram._eid) == [K[1], K[2]] and K[0] in disk
    assert sim.lookup([K[1], K[0], K[2]]) == [0]
    assert (sim.counters["promotions"], sim.counters["promotion_failures"]) == (0, 1)


def test_landing_feed_must_name_the_promoted_keys() -> None:
    ram, disk = PolicyTier("ram", 4), SegmentLog("disk", 2, 1 << 20, 32768)
    sim = CacheSim([ram, disk], landed=[K[9]])  # the daemon landed k9, the model promotes k0
    sim.put(K[:4])
    sim.put(K[4:5])  # k0 leaves RAM for its disk copy
    assert sim.lookup([K[0]]) == [1] and sim.landing_mismatches == 1 and K[0] in ram


def test_store_spec_policies() -> None:
    spec = StoreSpec.ram_disk(10_000, 49_152, policy="s3fifo")
    assert spec.daemon_options()["policy"] == "s3fifo"
    assert [type(t) for t in spec.sim_tiers()] == [PolicyTier, SegmentLog]
    assert type(spec.with_policy("lru").sim_tiers()[0]) is LRUTier
    with pytest.raises(ValueError, match="policy='arc': use one of lru, s3fifo"):
        StoreSpec.ram(10_000, policy="arc")


def test_verdict_names_landing_mismatches_and_the_policy() -> None:
    p = {"capacity_tokens": 10_000, "disk_tokens": 49_152, "policy": "s3fifo", "requests": 469,
         "mismatched_requests": 0, "first_mismatches": [], "tier_checks": {}, "tier_mismatches": [],
         "mismatched_disk_hits": 0, "verify_failures": 0, "landing_mismatches": 3}
    assert mismatches(p) == ["RAM 10K + disk 49.2K (s3fifo): 3 probes' promotions landed (event stream) for "
                             "other keys than the simulator promoted"]


# -- store == simulator through a real daemon ----------------------------------------------------------------

def test_s3fifo_replay_ram_equals_simulation() -> None:
    # 469 AgentX calls into 19 blocks of RAM under S3-FIFO; the replay waits for lease releases before each put
    reqs = generate(SMALL)
    spec = StoreSpec.ram(10_000, policy="s3fifo")
    sim = simulate(reqs, spec.sim_tiers(), plan=spec.write_plan)
    store = replay(reqs, spec, sync_leases=True)
    assert store.verify_failures == 0 and store.hits == sim.hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert (sum(sim.hits), sim.evictions[0], sim.present_on_put, sim.store_full) == (2_618, 565, 156, 0)
    assert sum(simulate(reqs, spec.with_policy("lru").sim_tiers()).hits) == 2_553  # LRU at the same store


@pytest.mark.parametrize("reinsert_hits", [1, 0])
def test_s3fifo_replay_with_disk_tier_equals_simulation(reinsert_hits: int) -> None:
    # 19 blocks of RAM over 96 of disk: hundreds of promotions, many probes promoting several blocks at once,
    # which the daemon's two promoter threads land in either order. That order is a thread race and changes
    # the run (the total hit count moves by a block or so from run to run), so the totals are not pinned here:
    # the model follows the recorded order and must equal the store exactly, request by request and counter
    # by counter, every run.
    reqs = generate(SMALL)
    spec = StoreSpec.ram_disk(10_000, 49_152, reinsert_hits=reinsert_hits, policy="s3fifo")
    store, landed = replay_observed(reqs, spec, sync_leases=True)
    sim = simulate(reqs, spec.sim_tiers(), landed=landed, plan=spec.write_plan)
    assert store.verify_failures == 0 and sim.landing_mismatches == 0
    assert store.hits == sim.hits and store.disk_hits == sim.disk_hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert len(landed) == sim.counters["promotions"] == store.counters["promotions"]  # every promotion landed
    assert sum(len(d) >= 2 for d in sim.disk_hits) >= 50  # probes whose landing order was the threads' choice
    assert (sim.counters["disk_reinserted"] > 0) == (reinsert_hits > 0)
    assert store.synced_writes and store.counters["demote_dropped"] == 0


# -- S3-FIFO with hints ------------------------------------------------------------------------------------------

def test_hinted_tier_makes_the_engines_choices_on_a_random_script() -> None:
    # The same 400 operations on a real Engine (4 slots, S3-FIFO, hints) and on the model's tier: after each,
    # the same blocks are resident. Puts, hits (deferred on both sides), Retain, Release, Pin (budget: 2 blocks).
    import random

    from tests.engine_helpers import NS, put
    from tests.test_engine_hints import make_engine

    eng, _ = make_engine("s3fifo")
    tier = HintedPolicyTier("ram", 4)
    rng = random.Random(7)
    keys = [f"k{i}".encode() for i in range(9)]
    for step in range(400):
        present = [k for k in keys if k in tier]
        absent = [k for k in keys if k not in tier]
        op = rng.choice(["put", "put", "touch", "touch", "retain", "release", "pin"])
        if op == "put" or not present:
            k = rng.choice(absent)
            put(eng, [k])
            assert tier.admit([k], ())[0]
        elif op == "touch":
            ks = rng.sample(present, rng.randint(1, len(present)))
            assert eng.lookup(NS, ks, lease=False).present == [True] * len(ks)
            tier.touch(ks)
        elif op == "pin":
            k = rng.choice(present)
            got = eng.hint(NS, [k], "pin", 20)
            assert got == (["accepted"] if tier.pin(k) else ["rejected"]), step
        else:
            k = rng.choice(present)
            assert eng.hint(NS, [k], op, 20) == ["accepted"]
            tier.retain(k, 20, False) if op == "retain" else tier.release(k)
        assert {k for k, p in zip(keys, eng.exists(NS, keys)) if p} == {k for k in keys if k in tier}, (step, op)
    # the budget filled (two pinned blocks, never evicted since) and the script evicted often
    assert len(tier.pinned) == 2 and sum(i.pins for i in eng.describe(NS, sorted(tier.pinned))) == 2
    c = eng.stats().counters
    assert (c["evictions"], c["hint_pin_rejected"]) == (122, 19)


def test_s3fifo_with_hints_replay_equals_simulation() -> None:
    # AgentX's hints (pins, retains over tool waits, releases) through a real daemon under S3-FIFO, RAM alone
    # and RAM + disk (promotion order recorded): store == model request by request, hint outcomes included.
    reqs = generate(AgentXParams(sessions=6, scale=0.05, seed=1, hints=True))
    spec = StoreSpec.ram(12_697, policy="s3fifo")
    store = replay(reqs, spec, sync_leases=True, hints=True)
    sim = simulate_hinted(reqs, spec.sim_tiers(), plan=spec.write_plan)
    assert store.verify_failures == 0 and store.hits == sim.hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert {k: v for k, v in sim.counters.items() if k.startswith("hint_")} == {
        "hint_pin_accepted": 6, "hint_retain_accepted": 2_551, "hint_retain_missing": 11,
        "hint_release_accepted": 123} == store.hint_outcomes
    assert (sum(sim.hits), sum(simulate(reqs, spec.sim_tiers(), plan=spec.write_plan).hits)) == (2_924, 2_780)  # hinted vs plain S3-FIFO
    spec = StoreSpec.ram_disk(10_000, 49_152, policy="s3fifo")
    store, landed = replay_observed(reqs, spec, sync_leases=True, hints=True)
    sim = simulate_hinted(reqs, spec.sim_tiers(), landed=landed, plan=spec.write_plan)
    assert store.verify_failures == 0 and sim.landing_mismatches == 0
    assert store.hits == sim.hits and store.disk_hits == sim.disk_hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert sim.counters["hint_retain_accepted"] > 0 and sim.counters["promotions"] > 0
