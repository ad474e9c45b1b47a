"""The RAM-tier engine's stats (every field exact, and an empty engine's) and its memory per committed entry.

Default rig (tests/engine_helpers.py): 4 MiB of data in 1 MiB slabs (4 slabs; max_block_bytes = slab), data at
DO = 2 MiB, so slab i starts at DO + i MiB and its generation sits at index i * 256 of the table.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from kvstore.arena.allocator import ClassUsage
from kvstore.engine.results import NamespaceUsage
from kvstore.engine.counters import RESTART_DROP_REASONS
from kvstore.hint_vocab import HINT_COUNTER_NAMES
from tests.engine_helpers import NS, KiB, MiB, make_rig, put

# A policy that loops over ineligible entries must fail the test, not hang the run.
pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------------- stats


def test_stats_exact_fields() -> None:
    rig = make_rig(max_block=64 * KiB)
    eng = rig.engine
    # a (64 KiB), b (20000 B -> 20 KiB slot), c (4 KiB) committed; d (5000 B -> 8 KiB slot) reserved
    put(eng, [b"a"], size=64 * KiB)
    put(eng, [b"b"], size=20000)
    put(eng, [b"c"], size=4 * KiB)
    eng.reserve(NS, [b"d"], [5000])
    eng.pin(NS, [b"a", b"c"], 1)
    lease = eng.lookup(NS, [b"b", b"c"]).lease_id
    eng.lookup(NS, [b"nope"], lease=False)
    st = eng.stats()
    assert (st.policy, st.capacity_bytes, st.slab_bytes, st.slabs_total, st.slabs_free) == (
        "lru", 4 * MiB, 64 * KiB, 64, 60)
    assert st.allocated_bytes == 64 * KiB + 20 * KiB + 4 * KiB + 8 * KiB
    assert st.stored_bytes == 64 * KiB + 20000 + 4 * KiB
    assert st.reserved_bytes == 8 * KiB  # slot bytes of reserved blocks
    assert st.leased_bytes == 20000 + 4 * KiB
    assert st.pinned_bytes == 64 * KiB + 4 * KiB
    # fragmentation: the share of allocated slot bytes not holding stored bytes; stranded: assigned slabs' free
    # slots (4 slabs of 64 KiB minus the 96 KiB of slots in use)
    assert st.fragmentation == pytest.approx(1 - (64 * KiB + 20000 + 4 * KiB) / (96 * KiB))
    assert st.stranded_bytes == 4 * 64 * KiB - 96 * KiB
    assert (st.blocks, st.leases_active, st.reservations_active) == (3, 1, 1)
    assert (st.high_watermark, st.low_watermark) == (0.95, 0.90)
    assert st.namespaces == [NamespaceUsage(NS, "", "", "", 3, 64 * KiB + 20000 + 4 * KiB, 3, 2, 3)]
    assert st.size_classes == [
        ClassUsage(4 * KiB, 1, 1, 15), ClassUsage(8 * KiB, 1, 1, 7),
        ClassUsage(20 * KiB, 1, 1, 2), ClassUsage(64 * KiB, 1, 1, 0),
    ]
    assert st.counters == {
        "reserve_calls": 4, "reserved_blocks": 4, "committed_blocks": 3,
        "committed_bytes": 64 * KiB + 20000 + 4 * KiB, "aborted_blocks": 0, "lookup_calls": 2,
        "lookup_keys": 3, "hit_keys": 2, "evictions": 0, "evicted_bytes": 0, "deleted_blocks": 0,
        "lease_expirations": 0, "reservation_expirations": 0, "quarantine_freed": 0, "store_full": 0,
        "checksum_failures": 0, "hit_keys_ram": 2, "hit_keys_disk": 0, "hit_keys_peer": 0, "promotions": 0,
        "promotion_failures": 0,
        "disk_writes": 0, "disk_write_failures": 0, "demote_dropped": 0, "demote_queue_full": 0,
        "evicted_to_disk": 0, "hit_bytes_ram": 20000 + 4 * KiB, "hit_bytes_disk": 0, "disk_reinserted": 0,
        "disk_writes_queued": 0, "disk_writebacks": 0, "evicted_unwritten": 0, "room_waits": 0,
        "slab_binds": 0, "slab_bind_failures": 0,
        # no prefix Lookup stopped short (both Lookups above are without prefix): no miss has a cause
        "misses_never_stored": 0, "misses_evicted": 0, "misses_disk_reclaimed": 0, "misses_deleted": 0,
        "misses_cleared": 0, "misses_other_namespace": 0, "misses_load_failed": 0,
        # no scheduler claimed anything
        "claim_claimed_keys": 0, "claim_pending_keys": 0, "claim_held_keys": 0, "claim_refused_keys": 0,
        **dict.fromkeys(HINT_COUNTER_NAMES, 0), "hints_late_rejected": 0,  # no hint was sent
        # no restart handed this engine a predecessor's blocks
        "restart_adopted_blocks": 0, **{f"restart_dropped_{r}": 0 for r in RESTART_DROP_REASONS},
    }
    eng.release([lease])
    assert eng.stats().leased_bytes == 0


def test_stats_of_empty_engine() -> None:
    st = make_rig().engine.stats()
    assert (st.allocated_bytes, st.stored_bytes, st.reserved_bytes, st.blocks, st.fragmentation) == (0, 0, 0, 0, 0.0)
    assert st.size_classes == [] and st.slabs_free == 4


# ----------------------------------------------------------------------------------------- memory


def test_memory_per_committed_entry_under_256_bytes() -> None:
    n, batch = 200_000, 256
    rig = make_rig(data_bytes=1024 * MiB, max_block=1 * MiB)  # 200k x 4 KiB = 78 % of the arena: no eviction
    eng = rig.engine
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        # keys are created in the traced region: the engine keeps them, so they are part of the cost
        for start in range(0, n, batch):
            keys = [b"block-%016x" % i for i in range(start, min(start + batch, n))]
            r = eng.reserve(NS, keys, [4 * KiB] * len(keys))
            eng.commit(r.reservation_id)
        del keys, r
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    per_entry = (after - before) / n
    print(f"\nengine heap per committed 4 KiB entry: {per_entry:.1f} bytes")
    assert eng.stats().blocks == n
    assert per_entry < 256, per_entry
