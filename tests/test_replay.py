"""Tests of bench.replay: the exact simulator (RAM and disk rules), stable keys, the AgentX generator, and two
real replays (RAM alone; RAM + disk with FIFO segment reclamation), each equal to its simulation.

The simulator tests are scripts over hand-made traces with every expected hit spelled out; RAM contents are
written least recent first, disk segments oldest first. Blocks are named by request letter and hash id:
a1 = key of [1], a2 = key of [1, 2], b4 = key of [1, 2, 4], c5 = key of [5] ...
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
from bench.replay.metrics import CostModel, capacity_model, hit_figures
from bench.replay.replayer import ReplayResult, replay
from bench.replay.report import markdown_table, series_from_points
from bench.replay.run import _tier_checks
from bench.replay.sim import LRUTier, SegmentLog, infinite_cache, simulate
from bench.replay.tiers import StoreSpec
from bench.replay.trace import DEFAULT_TRACE, Convention, Request, load_trace, write_trace
from bench.replay.verdict import EXIT_MISMATCH, mismatches
from tests.required import needs


def _req(*ids: int, tokens: int | None = None, t: int = 0) -> Request:
    """A request whose prompt is exactly these full blocks (or `tokens` long)."""
    return Request(t, tokens if tokens is not None else 512 * len(ids), 10, tuple(ids))


# -- simulator ---------------------------------------------------------------------------------------------

def test_lru_script_touch_order_and_present_blocks_kept() -> None:
    trace = [
        _req(1, 2, 3),  # A: miss all; put a1 a2 a3                 RAM: a1 a2 a3
        _req(1, 2, 4),  # B: hit a1 a2 (touched); put b4            RAM: a3 a1 a2 b4
        _req(5, 6),     # C: miss; put c5 c6 -> evicts a3, a1       RAM: a2 b4 c5 c6
        _req(1, 2, 3),  # D: a1 is gone -> 0 hits. put [a1 a2 a3]: a2 is present (an orphaned tail): kept and not
                        #    touched; a1, a3 need 2 slots -> evict b4, c5 (skipping a2)   RAM: a2 c6 a1 a3
        _req(1, 2, 4),  # E: hit a1 a2 (b4 was evicted) -> 2 hits; put b4 -> evicts c6    RAM: a3 a1 a2 b4
        _req(5, 6),     # F: c5 gone -> 0 hits; put c5 c6 -> evicts a3, a1                RAM: a2 b4 c5 c6
        _req(1, 2),     # G: a1 gone -> 0 hits; put a1 (a2 present) -> evicts b4          RAM: a2 c5 c6 a1
        _req(5, 6),     # H: 2 hits
    ]
    r = simulate(trace, [LRUTier("ram", 4)])
    assert r.hits == [0, 2, 0, 0, 2, 0, 0, 2]
    assert r.present_on_put == 2  # a2 at D and at G
    assert r.evictions == [2 + 2 + 1 + 2 + 1]
    assert r.resident == [4]
    # Had D evicted the present a2 (no `keep`), E would hit only a1: the daemon's Reserve rule matters.


def test_put_is_all_or_nothing_like_reserve() -> None:
    trace = [
        _req(1, 2),     # put a1 a2                                          RAM: a1 a2
        _req(3, 4, 5),  # 3 new blocks, 2 slots: both evicted, nothing stored RAM: (empty), store_full
        _req(1, 2),     # 0 hits
    ]
    r = simulate(trace, [LRUTier("ram", 2)])
    assert (r.hits, r.store_full, r.stored_blocks, r.resident) == ([0, 0, 0], 1, 4, [2])


def test_disk_tier_promotes_hits_and_keeps_its_copy() -> None:
    # Every stored block is written to disk (write-behind); a RAM eviction drops only the RAM copy; a disk hit
    # is promoted (it is then in RAM and on disk) and never rewritten.
    disk = SegmentLog("disk", segments=8, segment_bytes=8192, block_bytes=4096)
    trace = [
        _req(1, 2),     # A: miss; put a1 a2, both written              RAM: a1 a2    disk: a1 a2
        _req(3, 4),     # B: miss; put b3 b4 -> evicts a1 a2 (RAM copies only)    RAM: b3 b4    disk: + b3 b4
        _req(1, 2),     # C: 2 disk hits: a1 promoted (evicts b3), a2 promoted (evicts b4, not the promoting a1)
        _req(3, 4),     # D: 2 disk hits: b3 b4 are still on disk       RAM: b3 b4
        _req(1, 2, 5),  # E: 2 disk hits (evicting b3 b4); put c5 -> evicts a1       RAM: a2 c5    disk: + c5
        _req(1, 2, 5),  # F: a2 c5 are RAM hits, held; a1 needs a slot but nothing else is evictable: its
                        #    promotion fails and the prefix ends there (0 hits); the put finds all 3 present
    ]
    r = simulate(trace, [LRUTier("ram", 2), disk])
    assert r.hits == [0, 0, 2, 2, 2, 0]
    assert r.disk_hits == [(), (), (0, 1), (0, 1), (0, 1), ()]
    assert r.hits_by_tier == [0, 6] and r.present_on_put == 3 and r.resident == [2, 5]
    c = r.counters
    assert (c["promotions"], c["promotion_failures"], c["disk_writes"]) == (6, 1, 5)  # promotions: no rewrite
    assert c["evictions"] == c["evicted_to_disk"] == 2 + 2 + 2 + 3
    # the daemon's counters: a probe counts its RAM and disk hits, then the get counts all as RAM hits
    assert (c["hit_keys_ram"], c["hit_keys_disk"]) == (6, 6)


def test_segment_log_reclaims_the_oldest_segment_whole() -> None:
    keys = [bytes([i]) * 32 for i in range(8)]
    log = SegmentLog("disk", segments=3, segment_bytes=16384, block_bytes=5000)
    assert (log.record_bytes, log.capacity_blocks) == (8192, 6)  # records round up to 4 KiB: 2 a segment
    assert log.write(keys[:6]) == [True] * 6  # [k0 k1] [k2 k3] [k4 k5]
    assert log.write(keys[6:7]) == [True]  # no free segment: the oldest, [k0 k1], goes whole
    assert [k in log for k in keys[:7]] == [False, False, True, True, True, True, True]
    assert log.write(keys[7:8]) == [True] and (log.reclaimed, len(log)) == (2, 6)  # fits in [k6 k7]
    # A batch never reclaims a segment it wrote itself: with 2 segments, a 5-block batch gets NO_SPACE.
    small = SegmentLog("disk", segments=2, segment_bytes=8192, block_bytes=4096)
    assert small.write(keys[:5]) == [True] * 4 + [False] and small.no_space == 1
    assert small.write(keys[5:6]) == [True] and keys[0] not in small and keys[2] in small


def test_disk_fifo_ignores_hits() -> None:
    # One record a segment, 3 segments, no second chance (reinsert_hits=0; with one record a segment there is
    # no room for one anyway): a hit neither keeps a block on disk nor rewrites it.
    disk = SegmentLog("disk", segments=3, segment_bytes=4096, block_bytes=4096, reinsert_hits=0)
    trace = [
        _req(1),  # put a1                                   RAM: a1      disk: [a1]
        _req(1),  # RAM hit
        _req(2),  # put b2                                   RAM: a1 b2   disk: [a1] [b2]
        _req(1),  # RAM hit                                  RAM: b2 a1
        _req(3),  # put c3 -> evicts b2                      RAM: a1 c3   disk: [a1] [b2] [c3]
        _req(2),  # disk hit: b2 promoted, evicting a1       RAM: c3 b2
        _req(4),  # put d4 -> evicts c3; the disk reclaims [a1], the hottest block   disk: [b2] [c3] [d4]
        _req(1),  # miss: a1 is gone; put a1 -> evicts b2; reclaims [b2]             disk: [c3] [d4] [a1]
        _req(2),  # miss: b2's hit did not rewrite it; put b2 -> evicts d4; reclaims [c3]
    ]
    r = simulate(trace, [LRUTier("ram", 2), disk])
    assert r.hits == [0, 1, 0, 1, 0, 1, 0, 0, 0]
    assert r.disk_hits[5] == (0,) and r.hits_by_tier == [2, 1]
    c = r.counters
    assert (c["evictions"], c["evicted_to_disk"], c["disk_writes"], c["disk_evicted_blocks"]) == (5, 5, 6, 3)
    assert (c["hit_keys_ram"], c["hit_keys_disk"], c["disk_blocks"]) == (5, 1, 3)


def test_disk_second_chance_keeps_promoted_blocks() -> None:
    # Two records a segment, 3 segments; a promotion is a read of the block's record. At reclamation, records
    # read since their write are copied to the start of the reclaimed segment (at most half of it: 1 record)
    # with their read count reset; the others leave.
    disk = SegmentLog("disk", segments=3, segment_bytes=8192, block_bytes=4096)
    assert (disk.reinsert_hits, disk.keep_max) == (1, 1)
    trace = [
        _req(1),  # A: put a1                                    RAM: a1      disk: [a1 -]
        _req(2),  # B: put b2                                    RAM: a1 b2   disk: [a1 b2]
        _req(3),  # C: put c3 -> evicts a1                       RAM: b2 c3   disk: [a1 b2] [c3 -]
        _req(1),  # D: disk hit: a1 promoted (read 1), evicts b2 RAM: c3 a1
        _req(4),  # E: put d4 -> evicts c3                       RAM: a1 d4   disk: [a1 b2] [c3 d4]
        _req(5),  # F: put e5 -> evicts a1                       RAM: d4 e5   disk: + [e5 -]
        _req(6),  # G: put f6 -> evicts d4                       RAM: e5 f6   disk: [a1 b2] [c3 d4] [e5 f6]
        _req(7),  # H: put g7 -> evicts e5; reclaims [a1 b2]: a1 was read -> kept (b2 goes)
                  #                                              disk: [c3 d4] [e5 f6] [a1 g7]
        _req(1),  # I: disk hit: a1 promoted again (plain FIFO: a miss), evicts f6      RAM: g7 a1
        _req(2),  # J: b2 is gone: miss; put b2 -> evicts g7; reclaims [c3 d4], neither read
                  #                                              disk: [e5 f6] [a1 g7] [b2 -]
    ]
    r = simulate(trace, [LRUTier("ram", 2), disk])
    assert r.hits == [0, 0, 0, 1, 0, 0, 0, 0, 1, 0]
    assert r.disk_hits[3] == r.disk_hits[8] == (0,)
    c = r.counters
    assert (c["disk_writes"], c["disk_reinserted"], c["disk_evicted_blocks"], c["disk_blocks"]) == (8, 1, 3, 5)
    assert (c["evictions"], c["evicted_to_disk"], c["promotions"]) == (8, 8, 2)
    assert (c["disk_bytes_written"], c["disk_bytes_read"]) == ((8 + 1) * 4096, (2 + 1) * 4096)  # + the copy
    fifo = simulate(trace, [LRUTier("ram", 2), SegmentLog("disk", 3, 8192, 4096, reinsert_hits=0)])
    assert fifo.hits == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]


def test_ram_copy_of_a_reclaimed_block_is_no_longer_on_disk() -> None:
    # Two segments of one record. The engine hears which blocks reclamation dropped: a RAM copy loses its
    # "on disk" mark, so its later eviction drops the block (not evicted_to_disk).
    disk = SegmentLog("disk", segments=2, segment_bytes=4096, block_bytes=4096)
    trace = [
        _req(1),  # put a1                                       RAM: a1      disk: [a1]
        _req(2),  # put b2                                       RAM: a1 b2   disk: [a1] [b2]
        _req(1),  # RAM hit                                      RAM: b2 a1
        _req(3),  # put c3 -> evicts b2 (to disk); reclaims [a1], whose RAM copy is unmarked   disk: [b2] [c3]
        _req(4),  # put d4 -> evicts a1: dropped, not moved to disk; reclaims [b2]             disk: [c3] [d4]
        _req(1),  # miss; put a1 -> evicts c3 (to disk); reclaims [c3]                       disk: [d4] [a1]
    ]
    r = simulate(trace, [LRUTier("ram", 2), disk])
    assert r.hits == [0, 0, 1, 0, 0, 0]
    # evictions b2, a1, c3: all but a1 kept a disk copy; reclaimed a1, b2, c3
    assert (r.counters["evictions"], r.counters["evicted_to_disk"], r.counters["disk_evicted_blocks"]) == (3, 2, 3)


def test_disk_writes_follow_chain_order() -> None:
    # The daemon queues a commit's blocks in the commit's (chain) order, whatever catalog ids they got.
    disk = SegmentLog("disk", segments=3, segment_bytes=4096, block_bytes=4096)  # one record a segment
    trace = [
        _req(1, 2),  # put a1 a2                                      disk: [a1] [a2]
        _req(3, 4),  # put b3 b4: evicts a1, a2; written b3 then b4   disk: [a2] [b3] [b4]
        _req(3),     # RAM hit b3                                     RAM: b4 b3
        _req(5, 6),  # put c5 c6: evicts b4, b3; written c5, c6 -> reclaims [a2], then [b3]   disk: [b4] [c5] [c6]
        _req(3, 4),  # b3 is gone (the chain's head went first): 0 hits; put b3 (b4 is on disk)
    ]
    r = simulate(trace, [LRUTier("ram", 2), disk])
    assert r.hits == [0, 0, 1, 0, 0] and r.present_on_put == 1
    assert (r.counters["disk_writes"], r.counters["disk_evicted_blocks"]) == (7, 4)


def test_partial_last_block_convention() -> None:
    r = _req(7, 8, tokens=1000)  # one full block and 488 tokens
    assert r.cacheable_ids(Convention.FULL_BLOCKS) == (7,)
    assert r.cacheable_ids(Convention.KEEP_PARTIAL) == (7, 8)
    trace = [r, r]
    full = hit_figures(trace, infinite_cache(trace).hits)
    assert (full.hit_tokens, full.input_tokens, full.block_hit_rate) == (512, 2000, 0.5)
    kept = hit_figures(trace, infinite_cache(trace, Convention.KEEP_PARTIAL).hits, Convention.KEEP_PARTIAL)
    assert kept.hit_tokens == 1000  # a partial block hit serves its 488 tokens, not 512


@needs(DEFAULT_TRACE.exists(), f"the conversation trace {DEFAULT_TRACE}",
       "it is shared/data/conversation_trace.jsonl beside the checkout (clone the repository next to shared/)")
def test_infinite_cache_reproduces_the_dataset_readme() -> None:
    reqs = load_trace(DEFAULT_TRACE)
    best = infinite_cache(reqs, Convention.KEEP_PARTIAL)
    assert best.resident == [182_790]
    assert round(hit_figures(reqs, best.hits, Convention.KEEP_PARTIAL).block_hit_rate, 3) == 0.366


def test_capacity_model() -> None:
    trace = [Request(0, 2048, 100, (1, 2, 3, 4), "s", 0), Request(9, 4096, 50, tuple(range(1, 9)), "s", 0)]
    m = capacity_model(trace, [0, 4], CostModel(prefill_tok_s=1024, decode_tok_s=50))
    # call 1: 2048/1024 + 100/50 = 4 s; call 2: (4096 - 2048)/1024 + 50/50 = 3 s; one task
    assert (m["gpu_s"], m["tasks"], m["ttna_p50_s"]) == (7.0, 1, 3.5)


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


# -- one real replay ---------------------------------------------------------------------------------------

def test_replay_through_real_daemon_equals_simulation() -> None:
    # 469 AgentX calls (6 sessions, 5 % scale) into 19 blocks of RAM, about one request's worth: 571 evictions,
    # 195 orphaned tails found present by puts, one put too large for what is evictable (all or nothing).
    reqs = generate(AgentXParams(sessions=6, scale=0.05, seed=1))
    spec = StoreSpec.ram(10_000)
    sim = simulate(reqs, spec.sim_tiers())
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


@pytest.mark.parametrize(("reinsert_hits", "reclaimed", "reinserted"), [(1, 41, 23), (0, 32, 0)])
def test_replay_with_disk_tier_equals_simulation(reinsert_hits: int, reclaimed: int, reinserted: int) -> None:
    # The same 469 calls into 19 blocks of RAM and 96 blocks of disk (3 segments of 1 MiB = 32 blocks of 32 KiB):
    # promotions, a failed all-or-nothing put, and reclamation, all exactly as modelled. Plain FIFO drops one
    # whole segment (32 blocks). With the second chance the first reclamation keeps 16 promoted records (half
    # a segment), so a second one comes sooner and keeps 7: 41 dropped, 23 copied.
    reqs = generate(AgentXParams(sessions=6, scale=0.05, seed=1))
    spec = StoreSpec.ram_disk(10_000, 49_152, reinsert_hits=reinsert_hits)
    assert spec.disk is not None and (spec.disk.segments, spec.disk.capacity_blocks) == (3, 96)
    sim = simulate(reqs, spec.sim_tiers())
    store = replay(reqs, spec)
    assert store.verify_failures == 0  # every promoted block came back from disk with its marks
    assert store.hits == sim.hits and store.disk_hits == sim.disk_hits
    checks = _tier_checks(store, sim)
    assert [k for k, (a, b) in checks.items() if a != b] == [], checks
    assert (sum(sim.hits), sim.hits_by_tier, sim.store_full) == (3_203, [2_724, 479], 1)
    c = sim.counters
    assert (c["promotions"], c["disk_writes"], c["disk_evicted_blocks"], c["disk_reinserted"]) == (
        479, 125, reclaimed, reinserted)
    assert c["disk_blocks"] == 125 - reclaimed and c["evicted_to_disk"] == 584   # one eviction lost its copy
    assert store.counters["disk_reinserted"] == reinserted
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
