"""Tests of bench.replay: stable chained keys and content marks, the AgentX generator, the glue (token parsing,
disk layout, tables), two real replays (RAM alone; RAM + disk with FIFO segment reclamation), each equal to its
simulation, and the verdict: any difference between store and simulation fails the run. The exact simulator's
own scripts (RAM and disk rules): test_replay_sim.py.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from bench.replay.agentx import AgentXParams, generate
from bench.replay.agentx_stats import agentx_stats
from bench.replay import run as replay_run
from bench.replay.cli import main as replay_main
from bench.replay.cli import parse_tokens
from bench.replay.keys import SEED, chain_keys, stamp, verify
from bench.replay.replayer import ReplayResult, replay
from bench.replay.report import markdown_table, series_from_points
from bench.replay.run import _tier_checks
from bench.replay.sim import simulate
from bench.replay.tiers import StoreSpec
from bench.replay.trace import load_trace, write_trace
from bench.replay.verdict import EXIT_MISMATCH, mismatches


# -- keys --------------------------------------------------------------------------------------------------

def test_chained_keys_are_stable() -> None:
    assert SEED == hashlib.sha256(b"kvstore.bench.replay/v1").digest()
    keys = chain_keys([0, 1, 2])
    assert keys[0] == hashlib.sha256(SEED + struct.pack("<Q", 0)).digest()
    assert keys[1] == hashlib.sha256(keys[0] + struct.pack("<Q", 1)).digest()
    assert [k.hex()[:16] for k in keys] == ["f4896c0e19ccc455", "681af02447df7b82", "c4d6ee67aa46149d"]
    assert chain_keys([7])[0].hex() == "b688cc59a2e040ce1a262f74a5e1cadf6910cc44212480976ce6960ac01e2e20"
    assert chain_keys([5, 2])[1] != chain_keys([6, 2])[1]  # a key names its whole prefix


def test_content_marks() -> None:
    import numpy as np

    rows = np.zeros((3, 4096), dtype=np.uint8)
    keys = chain_keys([1, 2, 3])
    stamp(rows, keys)
    assert verify(rows, keys) == 3
    rows[1, -1] ^= 0xFF
    assert verify(rows, keys) == 1  # trust stops at the first bad block


# -- AgentX generator --------------------------------------------------------------------------------------

def test_agentx_small_seeded_run_is_exact(tmp_path) -> None:
    reqs = generate(AgentXParams(sessions=8, scale=0.1, seed=7))
    assert len(reqs) == 525
    assert sum(len(r.hash_ids) for r in reqs) == 8_914
    assert sum(r.input_length for r in reqs) == 4_433_345
    assert sum(r.output_length for r in reqs) == 24_640
    s = agentx_stats(reqs)
    assert (s["median_turns"], s["fork_share"], s["median_subagents"]) == (43.5, 0.5, 3.5)
    assert s["reuse_fraction"] == 0.9666
    path = tmp_path / "agentx.jsonl"
    write_trace(path, reqs)
    assert load_trace(path) == reqs  # same format as the conversation trace, plus session_id and agent
    assert set(json.loads(path.read_text().splitlines()[0])) == {
        "timestamp", "input_length", "output_length", "hash_ids", "session_id", "agent"}


def test_agentx_statistics_match_targets() -> None:
    s = agentx_stats(generate(AgentXParams(sessions=100, seed=0)))
    assert abs(s["median_turns"] - 43) <= 1
    assert abs(s["median_final_input"] - 142_000) / 142_000 < 0.03
    assert abs(s["median_output"] - 444) / 444 < 0.05
    assert s["reuse_fraction"] > 0.96
    assert s["fork_share"] == 0.44 and s["median_subagents"] == 4


# -- glue --------------------------------------------------------------------------------------------------

def test_parse_tokens_and_spec() -> None:
    assert [parse_tokens(x) for x in ("3M", "500K", "1.5M", "4096")] == [3_000_000, 500_000, 1_500_000, 4096]
    opts = StoreSpec.ram(3_000_000, 64).daemon_options()
    assert opts["arena_bytes"] == 192_000_000 and opts["max_block_bytes"] == 32_768 and "disk_bytes" not in opts
    with pytest.raises(ValueError, match="multiple of 8"):
        StoreSpec.ram(3_000_000, 12)


def test_disk_layout_and_daemon_options() -> None:
    spec = StoreSpec.ram_disk(3_000_000, 30_000_000)
    d = spec.disk
    assert d is not None and (d.segment_bytes, d.segments, d.record_bytes) == (28 * 2**20, 65, 32_768)
    assert d.capacity_bytes <= 30_000_000 * 64 and d.capacity_blocks == 65 * 896  # rounded down to segments
    opts = spec.daemon_options()
    assert (opts["disk_bytes"], opts["disk_segment_bytes"]) == (d.capacity_bytes, d.segment_bytes)
    assert (opts["disk_sync"], opts["disk_admission"], opts["disk_codec"]) == ("none", "always", "none")
    assert spec.label == "RAM+disk" and StoreSpec.ram_disk(3_000_000, 0).label == "RAM"
    assert spec.sim_tiers()[1].capacity_blocks == d.capacity_blocks
    with pytest.raises(ValueError, match="segments"):
        StoreSpec.ram_disk(10_000, 20_000)  # 1.3 MB: a single 1 MiB segment


def _point(ram: int, disk: int, hit: float) -> dict:
    return {"capacity_tokens": ram, "disk_tokens": disk, "store": "RAM+disk" if disk else "RAM",
            "bytes_per_token": 64, "block_bytes": 32768, "arena_bytes": ram * 64, "disk_bytes": disk * 63,
            "hit_rate": hit, "sim_hit_rate": hit, "hit_rate_ram": 0.1435, "hit_rate_disk": hit - 0.1435,
            "max_hit_rate": 0.3734, "prefill_reduction": 1.17, "load_gbps": 0.06, "put_gbps": 0.15,
            "requests_per_s": 128, "disk_write_amplification": 1.1734 if disk else 0.0,
            "conditions": {"policy": "lru", "high_watermark": 1.0, "low_watermark": 1.0,
                           "lock_step": ["disk writes", "promotions"] if disk else []}}


def test_markdown_table_and_series() -> None:
    points = [_point(3_000_000, 0, 0.1435), _point(10_000_000, 0, 0.25), _point(3_000_000, 30_000_000, 0.35)]
    table = markdown_table(points, "t")
    assert "| 3M | RAM | 3M (183 MiB) | - | 0.1435 | 0.1435 | 0.1435 / 0.0000 | 38.4% | 1.170x | - |" in table
    assert ("| 33M | RAM+disk | 3M (183 MiB) | 30M (1802 MiB) | 0.3500 | 0.3500 | 0.1435 / 0.2065 | 93.7% | 1.170x "
            "| 1.17x |") in table
    assert table.count("| 128 | none |") == 2 and "| 128 | disk writes, promotions |" in table  # the lock-step column
    assert "Conditions: lru, watermarks high 1 / low 1" in table
    ram, disk = series_from_points(points)
    assert (ram.label, ram.capacity_tokens) == ("RAM", (3_000_000, 10_000_000))
    # the RAM+disk line starts at RAM alone (disk 0), on the total-capacity axis
    assert (disk.label, disk.capacity_tokens, disk.hit_rate) == ("RAM 3M + disk", (3_000_000, 33_000_000),
                                                                (0.1435, 0.35))
    assert ram.belady_hit_rate == disk.belady_hit_rate == ()     # points without the ceiling draw no Belady line


def test_the_sweep_plot_draws_belady_once_over_every_capacity(tmp_path) -> None:
    """Belady depends on the total capacity only: one line over the union of the series' capacities."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from bench.replay import report

    points = [{**_point(3_000_000, 0, 0.1435), "belady_hit_rate": 0.30},
              {**_point(10_000_000, 0, 0.25), "belady_hit_rate": 0.36},
              {**_point(3_000_000, 30_000_000, 0.35), "belady_hit_rate": 0.37}]
    series = series_from_points(points)
    assert [s.belady_hit_rate for s in series] == [(0.30, 0.36), (0.30, 0.37)]
    drawn: list = []
    real_savefig = plt.Figure.savefig

    def keep(fig, path, *a, **k):  # noqa: ANN001, ANN002, ANN003 - matplotlib's signature
        drawn.extend(line for ax in fig.axes for line in ax.get_lines() if line.get_label().startswith("Belady"))
        return real_savefig(fig, path, *a, **k)
    plt.Figure.savefig = keep  # type: ignore[method-assign]
    try:
        out = report.plot_sweep(series, 0.3734, tmp_path / "sweep.png", "t")
    finally:
        plt.Figure.savefig = real_savefig  # type: ignore[method-assign]
    assert out.exists() and len(drawn) == 1
    assert list(drawn[0].get_xdata()) == [3_000_000, 10_000_000, 33_000_000]
    assert list(drawn[0].get_ydata()) == [0.30, 0.36, 0.37]


# -- one real replay ---------------------------------------------------------------------------------------

def test_replay_through_real_daemon_equals_simulation() -> None:
    # 469 AgentX calls (6 sessions, 5 % scale) into 19 blocks of RAM, about one request's worth: 571 evictions,
    # 195 orphaned tails found present by puts, one put too large for what is evictable (all or nothing).
    reqs = generate(AgentXParams(sessions=6, scale=0.05, seed=1))
    spec = StoreSpec.ram(10_000)
    sim = simulate(reqs, spec.sim_tiers(), plan=spec.write_plan)
    store = replay(reqs, spec)
    assert store.verify_failures == 0
    assert store.hits == sim.hits
    assert (sum(sim.hits), sim.evictions[0], sim.present_on_put, sim.store_full) == (2_553, 571, 195, 1)
    assert (store.present_on_put, store.store_full) == (sim.present_on_put, sim.store_full)
    assert (store.counters["evictions"], store.resident_blocks) == (sim.evictions[0], sim.resident[0])
    # The client releases leases in the background; a block still leased when the put runs cannot be evicted,
    # which the simulator does not model. At this capacity the replay waits for the releases between load and
    # put (as vLLM's prefill compute would), which is what makes the run exact.
    assert store.synced_leases


@pytest.mark.parametrize(("write", "reinsert_hits", "figures"), [
    ("commit", 1, dict(hits=3_203, by_tier=[2_724, 479], full=1, writes=125, reclaimed=41, reinserted=23, moved=584)),
    ("commit", 0, dict(hits=3_203, by_tier=[2_724, 479], full=1, writes=125, reclaimed=32, reinserted=0, moved=584)),
    ("evict", 1, dict(hits=3_214, by_tier=[2_734, 480], full=0, writes=116, reclaimed=22, reinserted=10, moved=585)),
    ("evict", 0, dict(hits=3_214, by_tier=[2_734, 480], full=0, writes=116, reclaimed=32, reinserted=0, moved=585)),
])
def test_replay_with_disk_tier_equals_simulation(write: str, reinsert_hits: int, figures: dict) -> None:
    # The same 469 calls into 19 blocks of RAM and 96 blocks of disk (3 segments of 1 MiB = 32 blocks of 32 KiB):
    # promotions, reclamation (and under commit a failed all-or-nothing put), all exactly as modelled.
    # commit: every put is written at once (125 blocks). Plain FIFO drops one whole segment (32 blocks); with the
    # second chance the first reclamation keeps 16 promoted records (half a segment), so a second one comes
    # sooner and keeps 7: 41 dropped, 23 copied. evict: only the 116 blocks RAM let go of are written (each
    # before its slot was reused: a Reserve or a promotion waited for it), so the disk has room for more and the
    # put that failed under commit finds its victims; the second chance keeps 10 records of blocks read back
    # and evicted again, and none of those RAM still held.
    reqs = generate(AgentXParams(sessions=6, scale=0.05, seed=1))
    spec = StoreSpec.ram_disk(10_000, 49_152, reinsert_hits=reinsert_hits, disk_write=write)
    assert spec.disk is not None and (spec.disk.segments, spec.disk.capacity_blocks) == (3, 96)
    sim = simulate(reqs, spec.sim_tiers(), plan=spec.write_plan)
    store = replay(reqs, spec)
    assert store.verify_failures == 0  # every promoted block came back from disk with its marks
    assert store.hits == sim.hits and store.disk_hits == sim.disk_hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    f = figures
    assert (sum(sim.hits), sim.hits_by_tier, sim.store_full) == (f["hits"], f["by_tier"], f["full"])
    c = sim.counters
    assert (c["promotions"], c["disk_writes"], c["disk_evicted_blocks"], c["disk_reinserted"]) == (
        f["by_tier"][1], f["writes"], f["reclaimed"], f["reinserted"])
    assert c["disk_blocks"] == f["writes"] - f["reclaimed"]  # a reinserted record is one of those written
    assert c["evicted_to_disk"] == f["moved"]
    assert (c["disk_writebacks"], c["room_waits"] > 0) == ((f["writes"], True) if write == "evict" else (0, False))
    assert store.counters["disk_reinserted"] == f["reinserted"]
    assert store.synced_writes and store.counters["demote_dropped"] == 0


# -- store vs simulator: any difference fails the run ---------------------------------------------------------

def _exact_point() -> dict:
    return {"capacity_tokens": 10_000, "disk_tokens": 0, "requests": 469, "mismatched_requests": 0,
            "first_mismatches": [], "tier_checks": {"evictions": [571, 571], "resident_blocks": [19, 19]},
            "tier_mismatches": [], "mismatched_disk_hits": 0, "verify_failures": 0}


def test_verdict_names_each_difference() -> None:
    p = _exact_point()
    assert mismatches(p) == []
    p.update(mismatched_requests=2, first_mismatches=[(3, 1, 0), (7, 4, 5)], tier_mismatches=["evictions"],
             tier_checks={"evictions": [572, 571]}, mismatched_disk_hits=1, verify_failures=4)
    assert mismatches(p) == [
        "RAM 10K: 2 of 469 requests differ (first: request 3: store 1 hits, simulated 0, request 7: store 4 hits, "
        "simulated 5)",
        "RAM 10K: counter evictions: store 572, simulated 571",
        "RAM 10K: 1 requests were served from disk at other positions than simulated",
        "RAM 10K: 4 loaded blocks failed their content marks"]


_CLI = ["--agentx", "--sessions", "2", "--scale", "0.05", "--seed", "1", "--capacity-tokens", "10000"]


@pytest.mark.parametrize("doctor", [None, "hit", "counter"])
def test_cli_exits_non_zero_when_the_store_differs_from_the_simulation(
        doctor: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # The real replay through a real daemon, its result doctored after the fact the way a daemon bug would
    # show: one request's hit count, or one counter, off by one. The clean run must exit 0 and say under what
    # conditions it ran; a doctored one exit 2, naming the difference on stderr and in the JSON.
    def doctored(*a: object, **kw: object) -> ReplayResult:
        r = replay(*a, **kw)  # type: ignore[arg-type]  # passes the test's arguments through unchanged
        if doctor == "hit":
            r.hits[5] += 1
        elif doctor == "counter":
            r.counters["evictions"] += 1
        return r
    monkeypatch.setattr(replay_run, "replay", doctored)
    code = replay_main(_CLI)
    cap = capsys.readouterr()
    out = json.loads(cap.out.strip().splitlines()[-1])
    c = out["conditions"]
    assert (c["policy"], c["high_watermark"], c["low_watermark"], c["ram_blocks"]) == ("lru", 1.0, 1.0, 19)
    assert c["lock_step"] == ["leases"] and "disk_sync" not in c  # 19 blocks: below 4 x the largest request
    assert "conditions" in cap.out and "lock-step: leases" in cap.out
    if doctor is None:
        assert (code, out["exact"], out["mismatches"], out["mismatched_requests"]) == (0, True, [], 0)
        return
    assert code == EXIT_MISMATCH and out["exact"] is False and len(out["mismatches"]) == 1
    want = ("requests differ (first: request 5: store " if doctor == "hit" else "counter evictions: store ")
    assert want in out["mismatches"][0] and want in cap.err and "MISMATCH" in cap.err


@pytest.mark.parametrize(("admission", "figures"), [
    ("always", (17_782, 1, 891, 581, 0)),
    ("seen:2", (15_738, 0, 379, 165, 12)),
])
def test_a_replay_that_cleans_a_segment_equals_simulation(admission: str, figures: tuple) -> None:
    # 696 AgentX calls (10 sessions at 25 % scale) into 39 blocks of RAM and 8 segments of disk (32 blocks each),
    # disk_write = evict: RAM's victims fill the log, and the blocks promoted back keep their copies there.
    # always: once, a younger segment holds so few records RAM does not back (at most a third) that it is
    # cleaned instead of reclaiming the oldest (kvstore/tiers/disk/cleaning.py). seen:2: 12 victims whose copy
    # reclamation had dropped while RAM held them are written again although used once since their promotion
    # (admission is not asked twice: disk_link.write_back). The store follows the model through both exactly.
    reqs = generate(AgentXParams(sessions=10, scale=0.25, seed=1))
    spec = StoreSpec.ram_disk(20_000, 131_072, reinsert_hits=1, disk_write="evict", disk_admission=admission)
    assert spec.disk is not None and (spec.disk.segments, spec.disk.capacity_blocks) == (8, 256)
    sim = simulate(reqs, spec.sim_tiers(), plan=spec.write_plan)
    c = sim.counters
    assert (sum(sim.hits), c["disk_cleaned"], c["disk_evicted_blocks"], c["disk_reinserted"],
            c["disk_readmitted"]) == figures
    store = replay(reqs, spec)
    assert store.verify_failures == 0
    assert store.hits == sim.hits and store.disk_hits == sim.disk_hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert store.counters["disk_reinserted"] == figures[3]
