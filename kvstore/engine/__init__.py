"""The engine: the daemon's metadata for the RAM and disk tiers (which blocks exist, where, who holds them).

Import what you need from its module (`from kvstore.engine.engine import Engine`); this package re-exports
nothing, so importing one part never drags in the rest. Module map, from the top down:

    engine.py        Engine: the composition root, the one lock and every public operation (orchestration)
    queries.py       EngineQueries: Engine's read-only questions (ListKeys, Describe, Stats, disk state, owners)
    engine_lock.py   EngineLock: the one lock; work a call leaves for after its reply runs at the next taking
    writes.py        Writes: Reserve, Commit, Store (into spare slots); what a commit sets off (events, disk, ...)
    spares.py        SpareSlots: arena slots a same-node connection holds ahead of its puts
    lookups.py       Lookups: the steps of a Lookup across tiers (locate, RAM hits, promotions, leasing)
    views.py         Views: ListKeys, Describe, Stats (read-only; RAM half under the lock, disk half after)
    disk_link.py     DiskLink: when blocks are written (commit / evict), admission, the budget; the mover's hooks
    promotions.py    Promotions: disk blocks read back into slots, and the groups that wait for room
    movement.py      Mover: the disk writer and promoter threads (I/O outside the lock); Promotion
    namespaces.py    NamespaceTable: registration rules, lookup by name, owners
    reservations.py  ReservationTable: open reservations, TTL, quarantine, closed history; plan of a Reserve
    leases.py        LeaseTable: lease ids, per-entry holds, expiry
    ram_space.py     RamSpace: allocator, generations, policy, quotas (allocate / evict / free / watermarks)
    read_buffer.py   ReadBuffer: hits buffered for the policy, replayed in order
    quotas.py        TenantQuotas: per-tenant RAM floors that decide whose blocks may be evicted
    generations.py   GenerationIndex: where a slot's generation word lives
    catalog.py       Catalog, Namespace, EntryState: entry columns and the entry state machine
    key_mirror.py    KeyIndexMirror: each tenant's shared key index kept equal to what a Lookup finds in RAM
    ttl.py           TtlTable: ids with a deadline (leases, reservations)
    events.py        EventBus: stored / removed / moved events for routers
    misses.py        MissLedger: keys that left the store, when and why; KeyExplanation (Engine.explain)
    claims.py        ClaimTable: keys a scheduler is computing now, so another one waits for its save (Claim)
    miss_causes.py   the cause of a prefix Lookup's first missing key (the misses_* counters)
    hints.py         Hints: what each agent hint does to a key (priorities, demote, prefetch, pins), its outcome
    snapshot.py      Stats and key records built from the catalog
    results.py       value objects the engine returns (ReserveResult, LookupResult, EngineStats, ...)
    counters.py      Counters: the named monotonic counters Stats reports
    config.py        EngineConfig
    sessions.py      SessionBook: each agent session's latest chain of keys (own lock; the servicer holds it)
    restarts.py      EngineRestarts: Engine's restart operations (journal, freeze, export, adopt)
    journal_link.py  JournalLink: the RAM journal kept equal to the committed entries (sync, hashing)
    adoption.py      a predecessor's entries and live state placed in a fresh engine; what is exported

Every part below engine.py is called under the engine's lock and has no lock of its own, but sessions.py and
key_mirror.py (its tables, also handed out by the same-node socket); none
imports engine.py (tests/test_import_graph.py holds the graph free of cycles).
"""
