"""Tests of bench.replay.belady, the offline ceiling: hand-made traces where Belady and LRU differ (every hit
worked out in the comments), capacity 0, the unbounded pool equal to the infinite cache, and Belady >= LRU at
the same capacity on the real conversation trace (its quick cut) and an AgentX workload.

Blocks are named by request letter and hash id, as in test_replay_sim.py: a1 = key of [1], a2 = key of [1, 2],
b4 = key of [1, 2, 4], c5 = key of [5]. "next" is a block's next use: the index of the next request whose chain
holds it (N = never). The victim is the cached block with the farthest next use, the deepest on a tie; with
bypass the incoming block competes too.
"""

from __future__ import annotations

import json

import pytest

from bench.replay.agentx import AgentXParams, generate
from bench.replay.belady import belady, plan
from bench.replay.metrics import hit_figures
from bench.replay.sim import LRUTier, infinite_cache, simulate
from bench.replay.tiers import StoreSpec
from bench.replay.trace import DEFAULT_TRACE, Convention, Request, cut_trace, load_trace
from tests.required import needs


def _req(*ids: int, tokens: int | None = None) -> Request:
    return Request(0, tokens if tokens is not None else 512 * len(ids), 10, tuple(ids))


def test_farthest_next_use_with_and_without_bypass() -> None:
    trace = [_req(1), _req(2), _req(3), _req(1), _req(2)]  # 0..4; capacity 2
    # LRU: [1] [1 2] [2 3] (evicts 1) [3 1] (evicts 2) [1 2] (evicts 3): no hit at all.
    assert simulate(trace, [LRUTier("ram", 2)]).hits == [0, 0, 0, 0, 0]
    # Belady: after 0, 1 the pool holds a1 (next 3), b2 (next 4). Request 2's c3 (next N) is farther than both:
    # bypassed, so 3 and 4 hit.
    r = belady(trace, 2)
    assert (r.hits, r.stored_blocks, r.evictions, r.bypassed, r.resident) == ([0, 0, 0, 1, 1], 2, 0, 1, 2)
    # Without bypass c3 must be stored: it evicts the farthest, b2 (next 4): 3 hits a1, 4 misses b2 (evicting c3).
    r = belady(trace, 2, bypass=False)
    assert (r.hits, r.stored_blocks, r.evictions, r.bypassed) == ([0, 0, 0, 1, 0], 4, 2, 0)


def test_prefix_chain_keeps_the_shared_head() -> None:
    trace = [
        _req(1, 2, 3),  # 0: put a1 (next 2) a2 (next 2) a3 (next N)
        _req(7),        # 1: c7 (next 3): victims a1 (2), a2 (2), a3 (N) -> a3 goes     pool: a1 a2 c7
        _req(1, 2, 4),  # 2: hits a1 a2 (theirs now N, but this request's own: no victims); b4 (N) vs c7 (3):
                        #    b4 is farther, bypassed                                    pool: a1 a2 c7
        _req(7),        # 3: hit c7
    ]
    r = belady(trace, 3)
    assert (r.hits, r.evictions, r.bypassed) == ([0, 0, 2, 1], 1, 1)
    # LRU (capacity 3): 1 evicts a1 (least recent), so 2 finds no prefix (a2 is an orphaned tail) and its put of
    # a1 b4 evicts a3 and c7; 3 misses.
    assert simulate(trace, [LRUTier("ram", 3)]).hits == [0, 0, 0, 0]


def test_equal_next_use_evicts_the_tail_first() -> None:
    trace = [
        _req(1, 2),  # 0: a1 a2, both next 3
        _req(3),     # 1: c3 (next 2) needs room: a1 and a2 are equally far; the deeper a2 goes   pool: a1 c3
        _req(3),     # 2: hit c3 (now next N)
        _req(1, 2),  # 3: hit a1; a2 (N, depth 1) vs c3 (N, depth 0): a2 is the deeper, bypassed
    ]
    r = belady(trace, 2)
    assert (r.hits, r.evictions, r.bypassed) == ([0, 0, 1, 1], 1, 1)
    # Evicting the head a1 instead would have left a2 useless: request 3 would hit nothing. LRU does just that.
    assert simulate(trace, [LRUTier("ram", 2)]).hits == [0, 0, 1, 0]


def test_blocks_of_the_request_being_served_are_never_its_victims() -> None:
    trace = [
        _req(1),        # 0: a1 (next 1)
        _req(1, 2, 3),  # 1: hit a1 (next 2); a2 (next 2) fills the pool; a3 (N) needs room, but a1 and a2 are
                        #    this request's: no victim, a3 is not stored (not even without bypass)
        _req(1, 2),     # 2: hits a1 a2
    ]
    for bypass in (True, False):
        r = belady(trace, 2, bypass=bypass)
        assert (r.hits, r.stored_blocks, r.evictions, r.bypassed, r.resident) == ([0, 1, 2], 2, 0, 1, 2)


def test_capacity_zero_and_bad_capacity() -> None:
    trace = [_req(1, 2), _req(1, 2), _req(1, 2, 3)]
    r = belady(trace, 0)
    assert (r.hits, r.stored_blocks, r.bypassed, r.resident) == ([0, 0, 0], 0, 7, 0)
    with pytest.raises(ValueError, match="capacity_blocks=-1 must be >= 0"):
        belady(trace, -1)


def test_partial_blocks_follow_the_convention() -> None:
    trace = [_req(1, 2, tokens=700), _req(1, 2, tokens=700)]  # one full block and a partial one
    assert belady(trace, 4).hits == [0, 1]
    assert belady(trace, 4, Convention.KEEP_PARTIAL).hits == [0, 2]
    assert plan(trace, Convention.KEEP_PARTIAL).nexts == [[1, 1], [2, 2]]  # 2 = never (past the last request)


def test_unbounded_pool_equals_the_infinite_cache() -> None:
    reqs = generate(AgentXParams(sessions=8, scale=0.1, seed=7))
    p = plan(reqs)
    r = belady(p, None)
    assert r.hits == infinite_cache(reqs).hits
    assert (r.evictions, r.bypassed, r.resident) == (0, 0, p.blocks)
    assert belady(p, p.blocks).hits == r.hits  # every distinct block fits: nothing is ever evicted


def _ceiling_holds(reqs: list[Request], shares: tuple[float, ...]) -> list[tuple[int, int, int]]:
    """At each share of the unique blocks: (Belady, one-pool LRU, infinite) hit blocks, checking the order."""
    p = plan(reqs)
    most = sum(infinite_cache(reqs).hits)
    out = []
    for share in shares:
        cap = max(1, int(p.blocks * share))
        b, lru = sum(belady(p, cap).hits), sum(simulate(reqs, [LRUTier("pool", cap)]).hits)
        assert lru <= b <= most, (share, cap, lru, b, most)
        out.append((b, lru, most))
    return out


@needs(DEFAULT_TRACE.exists(), f"the conversation trace {DEFAULT_TRACE}",
       "it is shared/data/conversation_trace.jsonl beside the checkout (clone the repository next to shared/)")
def test_belady_beats_lru_on_the_conversation_trace() -> None:
    reqs = cut_trace(load_trace(DEFAULT_TRACE), window_s=900.0)  # bench.replay --quick's cut
    got = _ceiling_holds(reqs, (0.01, 0.02, 0.05))
    assert all(b > lru for b, lru, _ in got)  # strictly: at these sizes LRU is far below the ceiling
    # The tiered store at the CLI's quick headline (RAM 3M + disk 30M tokens) against Belady on the same blocks.
    spec = StoreSpec.ram_disk(3_000_000, 30_000_000)
    pool = spec.tiers[0].capacity_blocks + spec.disk.capacity_blocks  # type: ignore[union-attr]  # has a disk
    store = hit_figures(reqs, simulate(reqs, spec.sim_tiers(), plan=spec.write_plan).hits).hit_rate
    ceiling = hit_figures(reqs, belady(reqs, pool).hits).hit_rate
    assert store <= ceiling


def test_belady_beats_lru_on_agentx() -> None:
    reqs = generate(AgentXParams(sessions=20, scale=0.25))  # bench.replay --agentx --quick's workload
    got = _ceiling_holds(reqs, (0.02, 0.1, 0.25))
    assert got[0][0] > got[0][1] and got[1][0] > got[1][1]
    assert got[2][0] == got[2][2]  # a quarter of the unique blocks already holds everything reused


def test_cli_reports_the_ceiling_next_to_the_store(capsys: pytest.CaptureFixture[str]) -> None:
    # The real replay through a real daemon (RAM 10,000 tokens = 19 blocks): Belady at the same 19 blocks, the
    # simulator's LRU hit rate, and their ratio, in the summary and in the last JSON line.
    from bench.replay.cli import main as replay_main

    code = replay_main(["--agentx", "--sessions", "2", "--scale", "0.05", "--seed", "1", "--capacity-tokens", "10000"])
    cap = capsys.readouterr()
    out = json.loads(cap.out.strip().splitlines()[-1])
    reqs = generate(AgentXParams(sessions=2, scale=0.05, seed=1))
    want = hit_figures(reqs, belady(reqs, 19).hits)
    assert (code, out["exact"], out["belady_blocks"]) == (0, True, 19)
    assert out["belady_hit_rate"] == round(want.hit_rate, 5)
    assert out["belady_prefill_reduction"] == round(want.prefill_reduction, 4)
    assert out["lru_hit_rate"] == out["sim_hit_rate"] == out["hit_rate"] == out["lru_pool_hit_rate"]  # RAM alone
    assert out["lru_prefill_reduction"] == out["prefill_reduction"]
    assert out["lru_share_of_belady"] == round(out["lru_hit_rate"] / out["belady_hit_rate"], 4)
    assert out["lru_hit_rate"] < out["belady_hit_rate"] <= out["max_hit_rate"]
    assert "belady: hit rate / prefill reduction" in cap.out
