"""The daemon's stitched arena (kvstore/arena/backing.py) and the GPU pin bookkeeping that follows it
(kvstore_connector/pinning.py), in process with real memfds, real MAP_FIXED remaps and real client mappings.

Script (4 slabs of 1 MiB, domains "" = pool, "a", "b"):
    bind slab 1 pool -> a        a's file has it (epoch 1), the pool's pages are punched
    a writes through its own mapping; the daemon's view shows the same bytes
    bind slab 1 a -> b           b's file has it (epoch 1), a's copy is punched (reads zeros), a's epoch 2
    generations carried over +1, so a copy made under a's ownership is stale in b's file too
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore_connector.pinning import PinnedRanges
from kvstore.arena import vm
from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.backing import ArenaBacking
from kvstore.arena.layout import ArenaLayout
from kvstore.client.arena_map import ArenaMap

MIB = 1 << 20


@pytest.fixture()
def backing():
    b = ArenaBacking(ArenaLayout("t-backing", 4, MIB), isolated=True, lock="off")
    yield b
    b.destroy(unmap=True)


def _client_map(b: ArenaBacking, domain: str) -> ArenaMap:
    import os  # noqa: PLC0415

    return ArenaMap(os.dup(b.file_of(domain).fd), b.layout, incarnation=1, isolated=True)


def test_layout_generation_blocks_are_per_slab_and_page_aligned() -> None:
    lay = ArenaLayout("x", 4, MIB)
    assert lay.gen_stride == 512                       # 1 epoch + 256 page words, padded to one 4 KiB page
    assert lay.gen_stride * 8 % lay.page_bytes == 0
    assert lay.data_offset == 2 * MIB and lay.size_bytes == 2 * MIB + 4 * MIB
    off = lay.data_offset + 2 * MIB + 3 * 4096        # slab 2, page 3
    assert lay.slab_of(off) == 2 and lay.generation_index(off) == 2 * 512 + 1 + 3
    assert lay.generation_indices(np.array([off, lay.data_offset])).tolist() == [2 * 512 + 4, 1]
    assert lay.epoch_index(2) == 1024
    assert lay.contains_slot(off, 4096) and not lay.contains_slot(lay.data_offset + MIB - 4096, 8192)
    assert not lay.contains_slot(lay.data_offset - 4096, 4096) and not lay.contains_slot(lay.size_bytes, 1)


def test_a_batch_of_slots_is_checked_exactly_as_one_at_a_time() -> None:
    # first_outside (C, a client's check of every slot a daemon names) against contains_slot, at every edge:
    # before and after the data region, across a slab boundary, and values that would wrap around 64 bits
    lay = ArenaLayout.for_capacity("x", 8 * MIB, MIB)
    lo, hi = lay.data_offset, lay.size_bytes
    offsets = [0, lo - 1, lo, lo + 1, lo + MIB - 1, lo + MIB, hi - 4096, hi - 1, hi, hi + 1, 2**63, 2**64 - 1]
    sizes = [0, 1, 4096, MIB - 1, MIB, MIB + 1, hi, 2**63, 2**64 - 1]
    pairs = [(o, z) for o in offsets for z in sizes]
    one = [lay.contains_slot(o, z) for o, z in pairs]
    # in one slab: lo with 0..MIB (5), lo+1 with 0..MIB-1 (4), lo+MIB-1 with 0, 1 (2), lo+MIB (5), hi-4096 with
    # 0..4096 (3), hi-1 with 0, 1 (2), and an empty range at hi (1)
    assert sum(one) == 22
    for (o, z), ok in zip(pairs, one):
        assert lay.first_outside(np.array([o], np.uint64), np.array([z], np.uint64)) == (-1 if ok else 0), (o, z)
    good = [(o, z) for (o, z), ok in zip(pairs, one) if ok]
    bad_at = 7
    batch = good[:bad_at] + [(lo + MIB - 4096, 8192)] + good[bad_at:]  # a range across two slabs
    assert lay.first_outside(np.array([o for o, _ in batch], np.uint64), np.array([z for _, z in batch], np.uint64)) == bad_at
    assert lay.first_outside(np.array([o for o, _ in good], np.uint64), np.array([z for _, z in good], np.uint64)) == -1


def test_bind_moves_a_slab_with_its_generations_and_punches_the_old_file(backing: ArenaBacking) -> None:
    lay = backing.layout
    d_off, _ = lay.slab_data_range(1)
    g = lay.generation_index(d_off)
    backing.generations[g] = 41                        # the pool's history of this slot
    backing.bind(1, "", "a")
    a_map = _client_map(backing, "a")
    assert a_map.acquire()
    assert a_map.epoch(1) == 1 and int(backing.generations[g]) == 42 == int(a_map.generations[g])
    vm.byte_view(a_map.address + d_off, 8)[:] = 9     # a writes its slot through its own mapping
    assert backing.view[d_off: d_off + 8].tolist() == [9] * 8   # the daemon sees a's file at that place
    a_resident = backing.domains()["a"]
    assert a_resident == lay.gen_table_bytes + MIB

    backing.bind(1, "a", "b")
    b_map = _client_map(backing, "b")
    assert b_map.acquire()
    assert int(backing.generations[g]) == 43 == int(b_map.generations[g])   # a's old lease gen 42 is stale
    assert b_map.epoch(1) == 1 and a_map.epoch(1) == 2                    # both files know the slab moved
    assert backing.view[d_off: d_off + 8].tolist() == [0] * 8           # b's pages are fresh, not a's
    assert backing.domains()["a"] == lay.gen_table_bytes                # a's slab memory went back
    assert backing.domains()["b"] == lay.gen_table_bytes + MIB
    assert vm.byte_view(a_map.address + d_off, 8).tolist() == [0] * 8   # a's mapping reads a hole there
    a_map.release(), b_map.release()
    a_map.retire(), b_map.retire()


def test_allocator_prefers_a_domains_own_empty_slabs_then_the_pool_then_the_richest(backing: ArenaBacking) -> None:
    lay = backing.layout
    moves: list[tuple[int, str, str]] = []

    def bind(slab: int, old: str, new: str) -> None:
        moves.append((slab, old, new))
        backing.bind(slab, old, new)

    alloc = SlabAllocator(lay.data_offset, lay.data_bytes, MIB, bind=bind)
    a0, a1 = alloc.allocate(MIB, "a"), alloc.allocate(MIB, "a")
    b0 = alloc.allocate(MIB, "b")
    assert moves == [(0, "", "a"), (1, "", "a"), (2, "", "b")]
    alloc.free(a0)
    assert alloc.allocate(MIB, "a") == a0 and len(moves) == 3        # its own empty slab: no move
    alloc.free(a0), alloc.free(a1)
    assert alloc.allocate(MIB, "b") == lay.data_offset + 3 * MIB     # the pool's last slab first
    assert alloc.allocate(MIB, "b") is not None and moves[-1][1:] == ("a", "b")   # then a's (richest)
    assert alloc.domain_slabs() == {"a": 1, "b": 3} and alloc.binds == 5
    assert b0 is not None


def test_pins_follow_slab_epochs(backing: ArenaBacking) -> None:
    """PinnedRanges with recording register/unregister: a slab is pinned once per binding; after it left and
    came back, the next copy re-pins it; a slab that left is unpinned at the next ensure."""
    lay = backing.layout
    calls: list[tuple[str, int]] = []
    backing.bind(0, "", "a")
    backing.bind(1, "", "a")
    m = _client_map(backing, "a")
    assert m.acquire()
    base = m.address + lay.data_offset
    pins = PinnedRanges(m, lambda addr, n: calls.append(("reg", (addr - base) // MIB)),
                       lambda addr: calls.append(("unreg", (addr - base) // MIB)))
    slot0, slot1 = np.array([base + 4096], dtype=np.uint64), np.array([base + MIB + 8192], dtype=np.uint64)
    pins.ensure(slot0)
    pins.ensure(slot0)
    assert calls == [("reg", 0)]
    backing.bind(0, "a", "b")
    backing.bind(0, "b", "a")                                  # slab 0 left a and came back: new pages
    pins.ensure(slot0)
    assert calls == [("reg", 0), ("unreg", 0), ("reg", 0)]
    pins.ensure(slot1)
    backing.bind(1, "a", "b")                                  # slab 1 left for good
    pins.ensure(slot0)
    assert calls[-2:] == [("reg", 1), ("unreg", 1)]
    assert pins.registered() == {0: m.epoch(0)}
    pins.close()
    assert calls[-1] == ("unreg", 0) and pins.registered() == {}
    outside = np.array([m.address, m.address + lay.size_bytes], dtype=np.uint64)  # gen table / past the end
    assert pins.slabs_of(outside) == []
    m.release()
    m.retire()


def test_shared_arena_is_pinned_once_whole() -> None:
    b = ArenaBacking(ArenaLayout("t-shared", 2, MIB), isolated=False, lock="off")
    try:
        import os  # noqa: PLC0415

        m = ArenaMap(os.dup(b.file_of("").fd), b.layout, incarnation=1, isolated=False)
        calls: list[tuple[int, int]] = []
        pins = PinnedRanges(m, lambda addr, n: calls.append((addr, n)), lambda addr: calls.append((addr, -1)))
        pins.ensure(np.array([m.address + b.layout.data_offset], dtype=np.uint64))
        pins.ensure(np.array([m.address + b.layout.data_offset + MIB], dtype=np.uint64))
        pins.close()
        assert calls == [(m.address, m.size), (m.address, -1)]
        m.retire()
    finally:
        b.destroy(unmap=True)
