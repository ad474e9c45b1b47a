"""The RAM journal and the checks a successor runs on it: every damaged or stale header is dropped and counted.

A real arena (memfd, ArenaBacking) and a real engine write the journal; the tests then read it as a successor
does (kvstore/server/handover/inherit.py) and attack it: a flipped bit in a header, bytes changed under a record,
a slot freed since its record, a record of another geometry or format, a block without a checksum.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.backing import ArenaBacking
from kvstore.arena.files import ArenaFile
from kvstore.arena.journal import RECORD_LIVE, JournalMismatch, RamJournal, record_hash
from kvstore.arena.layout import ArenaLayout
from kvstore.arena.verify import verify
from kvstore.engine.engine import Engine
from kvstore.engine.results import EngineConfig
from kvstore.policies import make_policy
from kvstore.server.handover.inherit import open_arena, verified_entries

MiB = 1 << 20
NS = "m@1/journal"
BLOCK = 256 * 1024


def _daemon_side(n: int = 8) -> tuple[ArenaBacking, Engine, list[bytes], list[int]]:
    """An arena and engine as a daemon builds them, `n` blocks committed (block i full of byte i + 1)."""
    layout = ArenaLayout.for_capacity("journal-test", 16 * MiB, MiB)
    arena = ArenaBacking(layout, lock="off")
    alloc = SlabAllocator(layout.data_offset, layout.data_bytes, MiB)
    eng = Engine(EngineConfig(max_block_bytes=MiB), layout, arena.generations, alloc, make_policy("lru"))
    eng.attach_journal(arena.journal, arena.generations)
    eng.register_namespace(NS, tokens_per_block=16)
    keys = [bytes([i]) * 4 + b"\0" * 4 for i in range(n)]  # trailing zero bytes belong to the key
    r = eng.reserve(NS, keys, [BLOCK] * n)
    for i, off in enumerate(r.offsets):
        arena.view[off: off + BLOCK] = i + 1
    eng.commit(r.reservation_id)
    return arena, eng, keys, r.offsets


def _successor_view(arena: ArenaBacking) -> ArenaBacking:
    """The same files and journal mapped again, as a successor maps what it was handed."""
    files = {d: os.dup(f.fd) for d, f in arena.files().items()}
    got, why = open_arena(arena.layout, os.dup(arena.journal.fd), files, isolated=False, lock="off")
    assert got is not None, why
    return got


def test_records_say_what_the_catalog_says_and_verify() -> None:
    arena, eng, keys, offsets = _daemon_side()
    assert eng.sync_journal(arena.view, hash_missing=True) == 8
    succ = _successor_view(arena)
    entries, v, namespaces, bad = verified_entries(succ)
    assert (v.dropped, bad) == ({}, 0)
    assert entries.keys == keys and entries.offsets.tolist() == offsets
    assert entries.sizes.tolist() == [BLOCK] * 8
    assert entries.checksums.tolist() == [xxhash.xxh3_64_intdigest(bytes([i + 1]) * BLOCK) for i in range(8)]
    assert namespaces[0]["name"] == NS and namespaces[0]["tokens_per_block"] == 16
    assert v.hashed_blocks == 8 and v.hashed_bytes == 8 * BLOCK


def test_a_removed_entry_has_no_record_at_once() -> None:
    # delete 2, evict nothing: its record is cleared under the same lock, before any sync
    arena, eng, keys, _ = _daemon_side()
    eng.sync_journal(arena.view, hash_missing=True)
    assert eng.delete(NS, [keys[2]]) == 1
    entries, v, _, _ = verified_entries(_successor_view(arena))
    assert keys[2] not in entries.keys and len(entries.keys) == 7 and v.dropped == {}


def test_every_kind_of_damage_is_dropped_and_counted() -> None:
    arena, eng, keys, offsets = _daemon_side()
    eng.sync_journal(arena.view, hash_missing=True)
    j = arena.journal
    eid = {k: i for i, k in enumerate(j.scan().keys())}
    ids = j.scan().eids
    # 0: one bit of the key flipped (the header hash no longer holds)
    j.entries["key"][ids[eid[keys[0]]], 0] ^= 1
    # 1: the size grown by a page (its header rewritten with a valid hash: only the bytes' xxh3 can tell)
    rec = j.entries[ids[eid[keys[1]]]: ids[eid[keys[1]]] + 1].copy()
    rec["size"] += 4096
    rec["hash"] = record_hash(rec)
    j.entries[ids[eid[keys[1]]]] = rec[0]
    # 2: the block's bytes changed after its commit
    arena.view[offsets[2] + 100] ^= 0xFF
    # 3: the slot freed since its record was written (its generation moved on)
    arena.generations[arena.layout.generation_index(offsets[3])] += 1
    # 4: a record whose block has no checksum
    rec = j.entries[ids[eid[keys[4]]]: ids[eid[keys[4]]] + 1].copy()
    rec["checksum"] = 0
    rec["hash"] = record_hash(rec)
    j.entries[ids[eid[keys[4]]]] = rec[0]
    # 5: a slot outside the data region
    rec = j.entries[ids[eid[keys[5]]]: ids[eid[keys[5]]] + 1].copy()
    rec["offset"] = 4096
    rec["hash"] = record_hash(rec)
    j.entries[ids[eid[keys[5]]]] = rec[0]
    succ = _successor_view(arena)
    entries, v, _, _ = verified_entries(succ)
    assert v.dropped == {"header": 1, "checksum": 2, "generation": 1, "unchecked": 1, "geometry": 1}
    assert entries.keys == keys[6:]
    # the successor owns the journal: what failed is cleared, a second scan finds only the good ones
    assert len(succ.journal.scan().eids) == 2 and succ.journal.scan().bad_headers == 0


def test_a_torn_record_reads_as_absent() -> None:
    # written with `live` 0, made live last: a writer killed in between leaves nothing that says anything
    arena, eng, keys, _ = _daemon_side(2)
    eng.sync_journal(arena.view, hash_missing=True)
    j = arena.journal
    ids = j.scan().eids
    j.entries["live"][ids[0]] = 0
    j.entries["offset"][ids[0]] = 12345  # half of a new record
    scan = j.scan()
    assert scan.eids.tolist() == [ids[1]] and scan.bad_headers == 0
    assert int(j.entries["live"][ids[1]]) == RECORD_LIVE


def test_another_geometry_or_format_is_refused_with_the_reason() -> None:
    arena, eng, _, _ = _daemon_side(1)
    other = ArenaLayout.for_capacity("journal-test", 32 * MiB, MiB)
    with pytest.raises(JournalMismatch, match="arena was 16 slabs of 1048576 bytes.*32 slabs"):
        RamJournal.open(os.dup(arena.journal.fd), other)
    fd = os.dup(arena.journal.fd)
    os.pwrite(fd, (2).to_bytes(4, "little"), 8)  # the format word
    with pytest.raises(JournalMismatch, match="journal format 2"):
        RamJournal.open(fd, arena.layout)
    got, why = open_arena(arena.layout, -1, {"": os.dup(arena.files()[""].fd)}, isolated=False, lock="off")
    assert got is None and "no RAM journal" in why


def test_unhashed_blocks_are_hashed_only_when_asked() -> None:
    arena, eng, keys, _ = _daemon_side(3)
    assert eng.sync_journal(arena.view, hash_missing=False) == 3
    scan = arena.journal.scan()
    assert scan.records["checksum"].tolist() == [0, 0, 0]
    assert verify(scan, arena.layout, arena.view, arena.generations).dropped == {"unchecked": 3}
    assert eng.sync_journal(arena.view, hash_missing=True, everything=True) == 3
    assert np.all(arena.journal.scan().records["checksum"] != 0)
    assert eng.journal is not None and eng.journal.hashed == 3


def test_a_file_of_another_size_is_refused() -> None:
    arena, _, _, _ = _daemon_side(1)
    small = ArenaFile("other", 4096)
    with pytest.raises(ValueError, match="expected"):
        ArenaFile.adopt(os.dup(small.fd), "x", arena.layout.size_bytes)
    small.close()
