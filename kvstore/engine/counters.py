"""Named monotonic counters of the engine, reported by Stats (map `counters`) and exported to Prometheus.

A kvstore.counters.CounterSet: a fixed set of names, so a typo is an AttributeError in tests rather than a
silently new counter. Bumped under the engine's lock (`counters.evictions += 1`), so the set has no lock.
"""

from __future__ import annotations

from kvstore.counters import CounterSet
from kvstore.hint_vocab import HINT_COUNTER_NAMES

__all__ = ["Counters", "COUNTER_NAMES", "RESTART_DROP_REASONS"]

# why a block a predecessor held was not adopted: the record's checks, then the adoption's
RESTART_DROP_REASONS = ("header", "geometry", "generation", "unchecked", "checksum", "namespace", "duplicate",
                        "tenant_file", "slot")

COUNTER_NAMES: tuple[str, ...] = (
    "reserve_calls",
    "reserved_blocks",
    "committed_blocks",
    "committed_bytes",
    "aborted_blocks",
    "lookup_calls",
    "lookup_keys",
    "hit_keys",
    "evictions",
    "evicted_bytes",
    "deleted_blocks",
    "lease_expirations",
    "reservation_expirations",
    "quarantine_freed",
    "store_full",
    "checksum_failures",
    "hit_keys_ram",
    "hit_keys_disk",
    "hit_keys_peer",      # Lookups without lease that found keys on peers (being prefetched)
    "promotions",
    "promotion_failures",
    "disk_writes",
    "disk_write_failures",
    "demote_dropped",
    "demote_queue_full",
    "evicted_to_disk",
    "hit_bytes_ram",
    "hit_bytes_disk",
    "disk_reinserted",
    "disk_writes_queued",   # blocks accepted into the disk write queue (write-behind and write-backs)
    "disk_writebacks",      # of those, RAM victims written before their slot is freed (disk_write=evict, Demote)
    "evicted_unwritten",    # RAM victims with no disk copy left unwritten: admission, the budget, a Release, degraded
    "room_waits",           # Reserves that waited for victims' write-backs to land before their slots were free
    "slab_binds",         # empty arena slabs moved from one tenant's memory file to another's (tokens on)
    "slab_bind_failures",  # such moves that failed (no memory for the new tenant's pages): counted as store full
    # prefix Lookups that stopped short, by the cause of their first miss (misses.py; they add up to those Lookups)
    "misses_never_stored",
    "misses_evicted",
    "misses_disk_reclaimed",
    "misses_deleted",
    "misses_cleared",
    "misses_other_namespace",
    "misses_load_failed",
    # Claims (claims.py): keys a scheduler claimed to compute, found pending (another's claim), or could not
    # record (the table full of live claims)
    "claim_claimed_keys",
    "claim_pending_keys",
    "claim_held_keys",
    "claim_refused_keys",
    *HINT_COUNTER_NAMES,  # hint_<action>_<outcome>: each key's answer to a hint (kvstore/engine/hints.py)
    "hints_late_rejected",  # deferred hints (blocks awaiting their Commit) refused there: pin budget, write queue
    # a restart that kept the RAM tier (a hand-over, systemd's fd store): blocks adopted, and those dropped by the
    # check they failed (kvstore/arena/verify.py, kvstore/engine/adoption.py)
    "restart_adopted_blocks",
    *(f"restart_dropped_{reason}" for reason in RESTART_DROP_REASONS),
)


class Counters(CounterSet):
    """The engine's counters (called under the engine's lock)."""

    __slots__ = COUNTER_NAMES
