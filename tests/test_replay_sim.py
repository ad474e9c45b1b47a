"""Tests of bench.replay's exact simulator (RAM and disk rules): the LRU script, all-or-nothing puts, promotion
and disk copies, FIFO and second-chance segment reclamation, chain-ordered writes, partial last blocks, the
infinite cache and the capacity model. The real replays, each equal to its simulation: test_replay.py.

The simulator tests are scripts over hand-made traces with every expected hit spelled out; RAM contents are
written least recent first, disk segments oldest first. Blocks are named by request letter and hash id:
a1 = key of [1], a2 = key of [1, 2], b4 = key of [1, 2, 4], c5 = key of [5] ...
"""

from __future__ import annotations

from bench.replay.metrics import CostModel, capacity_model, hit_figures
from bench.replay.sim import LRUTier, SegmentLog, infinite_cache, simulate
from bench.replay.trace import DEFAULT_TRACE, Convention, Request, load_trace
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


def test_segment_log_reuses_a_segment_whose_records_were_all_deleted() -> None:
    # The daemon's segments.take_dead: a Release deleted both records of the middle segment; the next segment
    # needed is that one, with nothing dropped, while the oldest (all live) waits its turn.
    keys = [bytes([i]) * 32 for i in range(8)]
    log = SegmentLog("disk", segments=3, segment_bytes=16384, block_bytes=5000)
    assert log.write(keys[:6]) == [True] * 6  # [k0 k1] [k2 k3] [k4 k5]
    log.remove(keys[2])
    assert log.write(keys[6:7]) == [True] and log.reclaimed == 2  # [k2 k3] still holds k3: [k0 k1] goes
    log.remove(keys[3])
    assert log.write(keys[7:8]) == [True]  # into [k6 _]
    assert log.write([keys[0]]) == [True] and log.reclaimed == 2  # [k2 k3] is dead: reused, nothing dropped
    assert [k in log for k in keys] == [True, False, False, False, True, True, True, True]


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
