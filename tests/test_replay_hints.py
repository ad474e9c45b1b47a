"""Tests of agent hints in bench.replay: the AgentX generator's hints (exact, seeded; off by default without
changing the trace), the model of the daemon's hint rules on hand-made sequences (release order, retention
skipped unless under pressure, pins never evicted and bounded, expiry on the trace's clock, outcomes per
tier), and store == model with hints through a real daemon (RAM alone; RAM + disk).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from bench.replay.agentx import AgentXParams, generate
from bench.replay.hints import EXPIRE_TTL_S, HintFeed, HintedLRU, Send, apply_hint, simulate_hinted
from bench.replay.keys import chain_keys
from bench.replay.replayer import replay
from bench.replay.run import _tier_checks
from bench.replay.sim import CacheSim, SegmentLog, simulate
from bench.replay.tiers import StoreSpec
from bench.replay.trace import Hint, Request, load_trace, write_trace

SMALL = dict(sessions=6, scale=0.05, seed=1)


# -- the generator -------------------------------------------------------------------------------------------

def test_agentx_hints_are_seeded_data_and_off_by_default(tmp_path) -> None:
    plain = generate(AgentXParams(**SMALL))
    hinted = generate(AgentXParams(**SMALL, hints=True))
    assert all(not r.hints for r in plain)
    assert [dataclasses.replace(r, hints=()) for r in hinted] == plain  # the same calls, no extra draws
    assert hinted == generate(AgentXParams(**SMALL, hints=True))
    n = Counter(h.action for r in hinted for h in r.hints)
    assert (len(hinted), n) == (469, {"prefetch": 442, "retain": 334, "release": 24, "pin": 6})
    assert sum(len(h.ids) - h.start for r in hinted for h in r.hints if h.action == "retain") == 2_216
    path = tmp_path / "hinted.jsonl"
    write_trace(path, hinted)
    assert load_trace(path) == hinted


def test_agentx_hints_follow_each_agent() -> None:
    reqs = generate(AgentXParams(**SMALL, hints=True))
    system = (0,)  # 12,288 x 0.05 tokens: one whole block
    end_ms = reqs[-1].timestamp_ms
    calls: dict[tuple[int, int], list[Request]] = {}
    for r in reqs:
        calls.setdefault((r.session_id, r.agent), []).append(r)  # type: ignore[arg-type]  # AgentX sets both
    for (sid, agent), rs in calls.items():
        for k, r in enumerate(rs):
            acts = [h.action for h in r.hints]
            pins = [h for h in r.hints if h.action == "pin"]
            assert len(pins) == (1 if agent == 0 and k == 0 else 0)
            for h in pins:  # the shared prefix, until the trace's last call
                assert (h.ids, h.start, h.ttl_s) == (system, 0, (end_ms - r.timestamp_ms) / 1000)
            if k:  # the tool returned: prefetch the chain the agent resumes, before the call
                assert r.hints[0] == Hint("prefetch", rs[k - 1].cacheable_ids(), 0, 0.0, before=True)
            else:
                assert "prefetch" not in acts
            retains = [h for h in r.hints if h.action == "retain"]
            if k == len(rs) - 1:
                assert not retains
                assert acts.count("release") <= 1
                assert agent or acts.count("release") == (1 if len(r.cacheable_ids()) > len(system) else 0)
                for h in r.hints:
                    if h.action == "release":
                        assert h.ids == r.cacheable_ids() and h.start >= len(system)
                        if agent:  # a sub-agent releases only past the context it forked from
                            parent = [p for p in calls[(sid, 0)] if p.timestamp_ms <= rs[0].timestamp_ms][-1]
                            assert h.start >= len(parent.cacheable_ids())
            else:
                gap = (rs[k + 1].timestamp_ms - r.timestamp_ms) / 1000
                want = [Hint("retain", r.cacheable_ids(), 1, gap)] if 0 < gap <= 5.0 and len(
                    r.cacheable_ids()) > 1 else []
                assert retains == want and "release" not in acts


# -- the model -------------------------------------------------------------------------------------------------

def _ram(*keys: bytes, cap: int = 4) -> CacheSim:
    sim = CacheSim([HintedLRU("ram", cap)])
    assert sim.ram.admit(list(keys), ())[0]
    return sim


def _order(sim: CacheSim) -> list[bytes]:
    return list(sim.ram._od)


def test_model_released_go_first_in_release_order_and_keep_their_place() -> None:
    sim = _ram(b"a", b"b", b"c", b"d")
    assert apply_hint(sim, Send("release", (b"c", b"b", b"x"), 0.0)) == ["accepted", "accepted", "missing"]
    assert apply_hint(sim, Send("release", (b"c",), 0.0)) == ["accepted"]  # again: keeps its place
    sim.ram.touch([b"b", b"c"])  # a hit does not undo a release
    assert sim.ram.admit([b"e"], ()) == (True, [b"c"])
    assert sim.ram.admit([b"f"], {b"b"}) == (True, [b"a"])  # a held released key is skipped: plain LRU
    assert sim.ram.admit([b"g"], ()) == (True, [b"b"])
    assert list(sim.ram.released) == []
    assert sim.counters["hint_release_accepted"] == 3 and sim.counters["hint_release_missing"] == 1


def test_model_retained_skipped_until_pressure_then_expired_by_the_feed() -> None:
    sim = _ram(b"a", b"b", b"c", b"d")
    assert apply_hint(sim, Send("retain", (b"a", b"b"), 600.0)) == ["accepted", "accepted"]
    assert sim.ram.admit([b"e"], ()) == (True, [b"c"])  # a, b retained: the least recent other goes
    assert sim.ram.admit([b"f"], {b"e"}) == (True, [b"d"])
    assert sim.ram.admit([b"g"], {b"e", b"f"}) == (True, [b"a"])  # only retained ones left: pressure
    assert _order(sim) == [b"b", b"e", b"f", b"g"] and sim.ram.retained == {b"b"}
    assert apply_hint(sim, Send("retain", (b"b",), 601.0)) == ["clipped"]
    assert apply_hint(sim, Send("retain", (b"b",), EXPIRE_TTL_S, expire=True)) == ["accepted"]
    assert sim.ram.retained == set()
    apply_hint(sim, Send("release", (b"e",), 0.0))
    apply_hint(sim, Send("retain", (b"e",), 600.0))  # a retain undoes a release
    assert list(sim.ram.released) == [] and sim.ram.admit([b"h"], ()) == (True, [b"b"])


def test_model_pins_are_never_evicted_and_bounded_by_half_the_ram() -> None:
    sim = _ram(b"a", b"b", b"c", b"d")
    assert apply_hint(sim, Send("pin", (b"a", b"b", b"c", b"a"), 600.0)) == [
        "accepted", "accepted", "rejected", "accepted"]  # 2 of 4 blocks; pinned again counts once
    apply_hint(sim, Send("release", (b"a",), 0.0))  # released but pinned: stays
    assert sim.ram.admit([b"e", b"f"], ()) == (True, [b"c", b"d"])
    assert sim.ram.admit([b"g", b"h", b"i"], ()) == (False, [b"e", b"f"])  # all or nothing: a, b stay
    assert _order(sim) == [b"a", b"b"]


def test_model_outcomes_on_disk_only_keys() -> None:
    disk = SegmentLog("disk", 3, 1 << 20, 32768)
    sim = CacheSim([HintedLRU("ram", 2), disk])
    disk.write([b"z"])
    assert [apply_hint(sim, Send(a, (b"z",), 1.0))[0] for a in ("retain", "pin", "release")] == [
        "rejected", "rejected", "accepted"]


def test_feed_ends_retains_on_the_trace_clock() -> None:
    feed = HintFeed()
    ids = (1, 2, 3)
    keys = tuple(chain_keys(ids))
    r0 = Request(1_000, 1536, 1, ids, 0, 0, (Hint("retain", ids, 1, 2.0), Hint("prefetch", ids, before=True)))
    assert feed.before(r0) == [] and feed.after(r0) == [Send("retain", keys[1:], 600.0)]
    assert feed.before(Request(3_000, 0, 1, ())) == []  # deadline 3,000 ms: it holds through that call
    assert feed.before(Request(3_001, 0, 1, ())) == [Send("retain", keys[1:], EXPIRE_TTL_S, expire=True)]
    r1 = Request(4_000, 1536, 1, ids, 0, 0, (Hint("retain", ids, 0, 1.0), Hint("release", ids, 2)))
    assert feed.after(r1) == [Send("retain", keys, 600.0), Send("release", keys[2:], 600.0)]
    assert feed.before(Request(9_000, 0, 1, ())) == [Send("retain", keys[:2], EXPIRE_TTL_S, expire=True)]


def test_hinted_model_beats_lru_on_a_small_workload() -> None:
    reqs = generate(AgentXParams(**SMALL, hints=True))
    spec = StoreSpec.ram(10_000)
    assert (sum(simulate(reqs, spec.sim_tiers(), plan=spec.write_plan).hits), sum(simulate_hinted(reqs, spec.sim_tiers(), plan=spec.write_plan).hits)) == (
        2_553, 2_612)


# -- store == model, hints included ------------------------------------------------------------------------------

def test_replay_with_hints_equals_the_model_ram() -> None:
    reqs = generate(AgentXParams(**SMALL, hints=True))
    spec = StoreSpec.ram(10_000)
    sim = simulate_hinted(reqs, spec.sim_tiers(), plan=spec.write_plan)
    store = replay(reqs, spec, hints=True)
    assert store.verify_failures == 0 and store.hits == sim.hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert (sum(sim.hits), sim.evictions[0], sim.store_full) == (2_612, 485, 2)
    assert {k: v for k, v in store.hint_outcomes.items()} == {
        "hint_pin_accepted": 6, "hint_retain_accepted": 2_539, "hint_release_accepted": 112,
        "hint_retain_missing": 23, "hint_release_missing": 11}


@pytest.mark.parametrize(("write", "reclaimed"), [("commit", 1), ("evict", 0)])
def test_replay_with_hints_equals_the_model_ram_and_disk(write: str, reclaimed: int) -> None:
    # 23 blocks of RAM, 96 of disk: promotions, Retains refused for keys only on disk, and reclamation under
    # commit. Releases let go on both tiers (their disk copies deleted) in both modes, so the disk keeps room:
    # one record reclaimed under commit (32 before Releases deleted), none under evict (it holds only what RAM
    # let go of and no Release did).
    # (At 19 blocks a probe whose RAM hits fill the whole RAM fails a promotion mid-prefix, and the daemon's
    # no-lease answer then lists hits past its prefix: a daemon bug, reported, not a hint question.)
    reqs = generate(AgentXParams(**SMALL, hints=True))
    spec = StoreSpec.ram_disk(12_000, 49_152, disk_write=write)
    sim = simulate_hinted(reqs, spec.sim_tiers(), plan=spec.write_plan)
    store = replay(reqs, spec, hints=True)
    assert store.verify_failures == 0 and store.hits == sim.hits and store.disk_hits == sim.disk_hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert (sum(sim.hits), sim.evictions, sim.counters["promotions"]) == (3_234, [316, reclaimed], 215)
    assert store.hint_outcomes == {"hint_pin_accepted": 6, "hint_retain_accepted": 2_556,
                                   "hint_release_accepted": 123, "hint_retain_rejected": 6}


# -- the CLI ---------------------------------------------------------------------------------------------------

def test_cli_hints_reports_lru_s3fifo_hints_and_belady_with_exact_store(capsys, tmp_path) -> None:
    from bench.replay.cli import main
    rc = main(["--agentx", "--sessions", "6", "--scale", "0.05", "--seed", "1", "--hints", "--ram-share", "1",
               "--hint-shares", "0.2,0.5", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    d = json.loads(out.strip().splitlines()[-1])
    assert d["exact"] and d["mismatches"] == []
    assert (d["share"], d["hint_hit_rate"], d["lru_hit_rate"], d["belady_hit_rate"]) == (
        0.2, 0.8163, 0.79153, 0.86946)
    assert (d["hint_gain"], d["hint_share_of_belady"]) == (1.1348, 0.9389)
    assert d["targets"] == {"hint_gain": 1.3, "hint_share_of_belady": 0.9, "hint_gain_met": False,
                            "hint_share_of_belady_met": True, "s3fifo_hint_gain_met": False,
                            "s3fifo_hint_share_of_belady_met": True}
    assert [(p["capacity_tokens"], p["disk_tokens"], p["hint_gain"]) for p in d["points"]] == [
        (12_697, 0, 1.1348), (31_744, 0, 1.0)]
    # S3-FIFO: the real store under policy s3fifo (no hints) equal to its exact simulator at each share
    assert (d["s3fifo_hit_rate"], d["s3fifo_prefill_reduction"]) == (0.77372, 4.4193)
    assert [(p["s3fifo_hit_rate"], p["s3fifo_sim_hit_rate"], p["s3fifo_mismatched_requests"],
             p["s3fifo_tier_mismatches"], p["s3fifo_landing_mismatches"]) for p in d["points"]] == [
        (0.77372, 0.77372, 0, [], 0), (0.89785, 0.89785, 0, [], 0)]
    assert (d["s3fifo_hint_hit_rate"], d["s3fifo_hint_prefill_reduction"], d["s3fifo_hint_gain"],
            d["s3fifo_hint_share_of_belady"]) == (0.8138, 5.3705, 1.1196, 0.936)
    assert [(p["s3fifo_hint_hit_rate"], p["s3fifo_hint_sim_hit_rate"], p["s3fifo_hint_mismatched_requests"],
             p["s3fifo_hint_tier_mismatches"]) for p in d["points"]] == [(0.8138, 0.8138, 0, []),
                                                                          (0.90008, 0.90008, 0, [])]
    for row in ("LRU (exact simulator)", "S3-FIFO (store)", "LRU + hints (store)", "S3-FIFO + hints (store)",
                "Belady (one pool)", "S3-FIFO + hints over LRU"):
        assert out.count(row) == 2, row  # one row per share
    png = tmp_path / "hints_agentx_sessions_6_scale_0_05_seed_1.png"
    assert d["plot"] == str(png) and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_cli_hints_refuses_what_it_cannot_run(capsys) -> None:
    from bench.replay.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--hints", "--limit", "5"])
    assert e.value.code == 2 and "--hints needs --agentx" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # 10 % of 6 sessions at 5 %: far below the disk tier's 3 segments
        main(["--agentx", "--sessions", "6", "--scale", "0.05", "--hints", "--hint-shares", "0.1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "use more --sessions, or --ram-share 1 (RAM alone)" in err
