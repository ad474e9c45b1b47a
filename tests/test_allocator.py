"""SlabAllocator and size_classes, driven with small real allocators and exact offsets.

Most tests use one shape: data at 2 MiB (where ArenaLayout puts it for small arenas), 64 KiB slabs, so a
4 KiB class holds 16 slots per slab and the arithmetic of every offset can be read off the comment.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.arena.allocator import ClassUsage, SlabAllocator, size_classes
from kvstore.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
PAGE = 4 * KiB
BASE = 2 * MiB
SLAB = 64 * KiB


def _alloc(n_slabs: int, slab: int = SLAB, base: int = BASE) -> SlabAllocator:
    return SlabAllocator(base, n_slabs * slab, slab)


# ----------------------------------------------------------------------------------------- size classes


def test_size_classes_exact_for_64k() -> None:
    # 4 KiB * 2^k * {1, 1.25, 1.5, 1.75} rounded up to pages; 5/6/7 KiB all round to 8 KiB
    assert size_classes(64 * KiB) == [
        4 * KiB, 8 * KiB, 12 * KiB, 16 * KiB, 20 * KiB, 24 * KiB, 28 * KiB,
        32 * KiB, 40 * KiB, 48 * KiB, 56 * KiB, 64 * KiB,
    ]


def test_size_classes_include_powers_of_two_and_max() -> None:
    classes = size_classes(3 * MiB)
    # every power of two from one page to 2 MiB is a class, and so is the (non power of two) max itself
    for k in range(12, 22):
        assert 1 << k in classes
    assert classes[-1] == 3 * MiB
    assert classes[-4:] == [1792 * KiB, 2 * MiB, 2560 * KiB, 3 * MiB]
    assert classes == sorted(set(classes))
    assert all(c % PAGE == 0 for c in classes)


def test_size_classes_below_one_page_max() -> None:
    # a max below one page yields just that max (SlabAllocator refuses such a slab anyway)
    assert size_classes(2048) == [2048]


def test_waste_below_20_percent_above_16k_and_zero_for_powers_of_two() -> None:
    a = _alloc(2, slab=4 * MiB)
    sizes = set(range(16 * KiB + 1, 4 * MiB + 1, 509))  # a prime step hits many offsets within classes
    for c in a.classes:
        sizes.update((c - 1, c, c + 1))
    for size in sorted(s for s in sizes if 16 * KiB < s <= 4 * MiB):
        slot = a.slot_bytes(size)
        assert slot >= size and slot % PAGE == 0
        assert (slot - size) / slot < 0.20, size
    for k in range(12, 23):
        assert a.slot_bytes(1 << k) == 1 << k
    # below 16 KiB page rounding dominates: documented, not a bug
    assert a.slot_bytes(1) == 4 * KiB
    assert a.slot_bytes(4 * KiB + 1) == 8 * KiB
    assert a.slot_bytes(8 * KiB + 1) == 12 * KiB
    # 16 KiB + 1 byte is the worst case just under the bound
    assert a.slot_bytes(16 * KiB + 1) == 20 * KiB


# ----------------------------------------------------------------------------------------- construction


def test_construction_errors() -> None:
    with pytest.raises(ConfigError, match="multiple of 4096"):
        SlabAllocator(BASE, 4 * SLAB, SLAB + 1)
    with pytest.raises(ConfigError, match="multiple of 4096"):
        SlabAllocator(BASE, 4 * SLAB, 0)
    with pytest.raises(ConfigError, match="not page-aligned"):
        SlabAllocator(BASE + 1, 4 * SLAB, SLAB)
    with pytest.raises(ConfigError, match="holds 1 slab"):
        SlabAllocator(BASE, 2 * SLAB - 1, SLAB)


def test_fresh_allocator_state() -> None:
    # capacity rounds down to whole slabs: 4.5 slabs -> 4
    a = SlabAllocator(BASE, 4 * SLAB + SLAB // 2, SLAB)
    assert (a.n_slabs, a.capacity, a.free_slabs, a.slab_bytes) == (4, 4 * SLAB, 4, SLAB)
    assert (a.allocated_bytes, a.assigned_bytes(), a.usage()) == (0, 0, [])
    assert a.classes == size_classes(SLAB)


# ----------------------------------------------------------------------------------------- scripted


def test_slab_claimed_on_first_slot_and_returned_when_empty() -> None:
    a = _alloc(4)
    # alloc 4 KiB -> claims slab 0 (lowest offset first): 1 used, 15 free slots in it
    off = a.allocate(4 * KiB)
    assert off == BASE
    assert a.free_slabs == 3 and a.assigned_bytes() == SLAB
    assert a.usage() == [ClassUsage(4 * KiB, 1, 1, 15)]
    assert a.allocated_bytes == 4 * KiB
    # free it -> the slab goes back to the pool and the class disappears from usage()
    a.free(off)
    assert a.free_slabs == 4 and a.assigned_bytes() == 0
    assert a.usage() == [] and a.allocated_bytes == 0
    # the returned slab can serve another class now: 64 KiB takes it whole
    assert a.allocate(64 * KiB) == BASE
    assert a.usage() == [ClassUsage(64 * KiB, 1, 1, 0)]


def test_bump_offsets_then_next_slab() -> None:
    a = _alloc(4)
    # 16 x 4 KiB fill slab 0 at BASE + 0, 4K, ..., 60K; the 17th claims slab 1 at BASE + 64K
    offs = [a.allocate(4 * KiB) for _ in range(17)]
    assert offs == [BASE + i * 4 * KiB for i in range(16)] + [BASE + SLAB]
    assert a.usage() == [ClassUsage(4 * KiB, 2, 17, 15)]
    assert a.free_slabs == 2
    assert a.allocated_bytes == 17 * 4 * KiB


def test_freed_slot_reused_before_new_slab_and_before_bump() -> None:
    a = _alloc(4)
    offs = [a.allocate(4 * KiB) for _ in range(16)]  # slab 0 full
    # free slots 3 and 7 of slab 0 -> slab 0 is partial again; next allocs reuse 7 then 3 (LIFO), no new slab
    a.free(offs[3])
    a.free(offs[7])
    assert a.usage() == [ClassUsage(4 * KiB, 1, 14, 2)]
    assert a.allocate(4 * KiB) == offs[7]
    assert a.allocate(4 * KiB) == offs[3]
    assert a.free_slabs == 3
    # slab 0 full again -> the next 4 KiB alloc claims slab 1
    assert a.allocate(4 * KiB) == BASE + SLAB


def test_partial_slab_reused_before_bump_of_fresh_slots() -> None:
    a = _alloc(4)
    # 3 allocs in slab 0 (slots 0..2); free slot 1 -> next alloc takes slot 1, not bump slot 3
    o0, o1, o2 = (a.allocate(4 * KiB) for _ in range(3))
    a.free(o1)
    assert a.allocate(4 * KiB) == o1
    assert a.allocate(4 * KiB) == BASE + 3 * 4 * KiB
    assert a.usage() == [ClassUsage(4 * KiB, 1, 4, 12)]
    assert (o0, o2) == (BASE, BASE + 8 * KiB)


def test_mixed_classes_use_separate_slabs() -> None:
    a = _alloc(4)
    # 4 KiB -> slab 0; 20000 B -> 20 KiB class, slab 1; 64 KiB -> slab 2; 3 KiB -> 4 KiB class, slab 0 again
    assert a.allocate(4 * KiB) == BASE
    assert a.allocate(20000) == BASE + SLAB
    assert a.allocate(64 * KiB) == BASE + 2 * SLAB
    assert a.allocate(3 * KiB) == BASE + 4 * KiB
    assert a.allocate(20 * KiB) == BASE + SLAB + 20 * KiB
    # 64 KiB // 20 KiB = 3 slots per slab (4 KiB of the slab is tail waste)
    assert a.usage() == [
        ClassUsage(4 * KiB, 1, 2, 14),
        ClassUsage(20 * KiB, 1, 2, 1),
        ClassUsage(64 * KiB, 1, 1, 0),
    ]
    # allocated_bytes counts slot bytes, not requested bytes: 4K + 20K + 64K + 4K + 20K
    assert a.allocated_bytes == 112 * KiB
    assert a.free_slabs == 1 and a.assigned_bytes() == 3 * SLAB


def test_capacity_exhaustion_returns_none() -> None:
    a = _alloc(2)
    # two 64 KiB blocks take both slabs -> a third, and even a 4 KiB one (needs a slab), get None
    big = [a.allocate(64 * KiB), a.allocate(64 * KiB)]
    assert big == [BASE, BASE + SLAB]
    assert a.allocate(64 * KiB) is None
    assert a.allocate(4 * KiB) is None
    assert a.allocated_bytes == 2 * SLAB and a.free_slabs == 0
    # free one -> its slab serves the 4 KiB class; 16 of them fit, the 17th gets None
    a.free(big[1])
    small = [a.allocate(4 * KiB) for _ in range(16)]
    assert small == [BASE + SLAB + i * 4 * KiB for i in range(16)]
    assert a.allocate(4 * KiB) is None
    assert a.allocated_bytes == 2 * SLAB
    assert a.usage() == [ClassUsage(4 * KiB, 1, 16, 0), ClassUsage(64 * KiB, 1, 1, 0)]


def test_slot_count_and_tail_waste_of_non_dividing_class() -> None:
    a = _alloc(2)
    # 24 KiB slots: 64 // 24 = 2 per slab; the third alloc needs slab 1
    assert [a.allocate(24 * KiB) for _ in range(3)] == [BASE, BASE + 24 * KiB, BASE + SLAB]
    assert a.usage() == [ClassUsage(24 * KiB, 2, 3, 1)]
    assert a.allocate(24 * KiB) == BASE + SLAB + 24 * KiB
    assert a.allocate(24 * KiB) is None


@pytest.mark.parametrize(
    "offset",
    [
        BASE + 4 * KiB,  # slot 1 of slab 0: beyond the bump index (never handed out)
        BASE + 1,  # inside slot 0, not its start
        BASE + 2 * KiB,  # not a slot start either
        BASE + SLAB,  # slab 1 is free
        BASE - SLAB,  # below the data region: would index the slab list from its end
        BASE - 1,
        0,
        BASE + 4 * SLAB,  # one past the end
        BASE + 100 * SLAB,
    ],
)
def test_free_of_invalid_offset_raises_and_changes_nothing(offset: int) -> None:
    a = _alloc(4)
    # slab 0: one 4 KiB slot in use; slabs 1..3: one 64 KiB slot each, then slab 1's freed again -> slab 3
    # is in use (a negative slab index would reach it) and slab 1 is free
    assert a.allocate(4 * KiB) == BASE
    assert [a.allocate(64 * KiB) for _ in range(3)] == [BASE + SLAB, BASE + 2 * SLAB, BASE + 3 * SLAB]
    a.free(BASE + SLAB)
    before = (a.allocated_bytes, a.usage(), a.free_slabs)
    with pytest.raises(ValueError, match="not an allocated slot"):
        a.free(offset)
    assert (a.allocated_bytes, a.usage(), a.free_slabs) == before


def test_double_free_raises() -> None:
    a = _alloc(2)
    # two slots in slab 0; free slot 0 twice -> the second raises (it would hand slot 0 out twice)
    o0, o1 = a.allocate(4 * KiB), a.allocate(4 * KiB)
    a.free(o0)
    with pytest.raises(ValueError, match="not an allocated slot"):
        a.free(o0)
    assert a.usage() == [ClassUsage(4 * KiB, 1, 1, 15)]
    assert a.allocate(4 * KiB) == o0
    assert a.allocate(4 * KiB) == BASE + 8 * KiB  # not o0 again
    # free the whole slab, then its old offsets are free-slab offsets: raise too
    for off in (o0, o1, BASE + 8 * KiB):
        a.free(off)
    with pytest.raises(ValueError):
        a.free(o1)
    assert a.free_slabs == 2 and a.allocated_bytes == 0


def _per_op_seconds(n_partial: int) -> float:
    """Seconds per allocate when `n_partial` slabs of the class are partly used and each alloc fills one."""
    a = _alloc(n_partial, slab=SLAB)
    offs = [a.allocate(4 * KiB) for _ in range(16 * n_partial)]
    for i in range(n_partial):  # one hole per slab, in slab order
        a.free(offs[16 * i])
    t0 = time.perf_counter()
    for _ in range(n_partial):
        a.allocate(4 * KiB)  # fills one slab, which leaves the partial set
    return (time.perf_counter() - t0) / n_partial


def test_allocate_and_free_are_o1() -> None:
    # 2k vs 32k partly used slabs: an allocator that scans the partial set (iterating a dict from its front
    # walks over deleted keys) gets >10x slower per op at 16x the slabs; O(1) stays flat. Best of 3 runs.
    small = min(_per_op_seconds(2_000) for _ in range(3))
    large = min(_per_op_seconds(32_000) for _ in range(3))
    assert large < 4 * small, (small, large)
    # free: time per op does not grow with the number of live slots either
    a = _alloc(32_000)
    offs = [a.allocate(4 * KiB) for _ in range(16 * 32_000)]
    t0 = time.perf_counter()
    for off in offs[:2_000]:
        a.free(off)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for off in offs[-2_000:]:
        a.free(off)
    last = time.perf_counter() - t0
    assert last < 4 * first + 0.01, (first, last)


# ----------------------------------------------------------------------------------------- property

N_SLABS = 6
_SIZES = st.one_of(
    st.sampled_from([1, 4 * KiB, 4 * KiB + 1, 16 * KiB, 20000, 32 * KiB, 48 * KiB, 64 * KiB]),
    st.integers(1, SLAB),
)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), _SIZES),
        st.tuples(st.just("free"), st.integers(0, 10_000)),
        st.tuples(st.just("refree"), st.integers(0, 10_000)),
        # mostly page-aligned (slot starts, where a double free would slip through) plus some odd offsets
        st.tuples(
            st.just("bad_free"),
            st.one_of(
                st.integers(-2 * SLAB // PAGE, (N_SLABS + 2) * SLAB // PAGE).map(lambda p: p * PAGE),
                st.integers(-2 * SLAB, (N_SLABS + 2) * SLAB),
            ),
        ),
    ),
    max_size=300,
)


def _check_invariants(a: SlabAllocator, live: dict[int, int]) -> None:
    spans = sorted((off, off + slot) for off, slot in live.items())
    for off, end in spans:
        assert off % PAGE == 0
        assert BASE <= off and end <= BASE + a.capacity
        # a slot never crosses a slab boundary
        assert (off - BASE) // SLAB == (end - 1 - BASE) // SLAB
    for (_, end), (nxt, _) in zip(spans, spans[1:]):
        assert end <= nxt, "overlapping slots"
    assert a.allocated_bytes == sum(live.values())
    usage = a.usage()
    assert sum(u.used_slots for u in usage) == len(live)
    assert sum(u.slabs for u in usage) + a.free_slabs == N_SLABS
    for u in usage:
        assert u.used_slots + u.free_slots == u.slabs * (SLAB // u.slot_bytes)
        assert u.used_slots == sum(1 for s in live.values() if s == u.slot_bytes)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_random_alloc_free_matches_reference_intervals(ops: list[tuple[str, int]]) -> None:
    a = _alloc(N_SLABS)
    live: dict[int, int] = {}  # offset -> slot bytes: the reference model
    freed: list[int] = []  # offsets freed at some point (candidates for a double free)
    for op, arg in ops:
        if op == "alloc":
            slot = a.slot_bytes(arg)
            off = a.allocate(arg)
            if off is None:
                # None only when no slab is free and every slab of the class is full
                assert a.free_slabs == 0
                assert all(u.free_slots == 0 for u in a.usage() if u.slot_bytes == slot)
            else:
                assert off not in live
                live[off] = slot
        elif op == "free" and live:
            off = sorted(live)[arg % len(live)]
            a.free(off)
            del live[off]
            freed.append(off)
        elif op in ("bad_free", "refree"):
            if op == "refree" and not freed:
                continue
            off = freed[arg % len(freed)] if op == "refree" else BASE + arg
            if off in live:
                continue
            before = (a.allocated_bytes, a.usage(), a.free_slabs)
            with pytest.raises(ValueError):
                a.free(off)
            assert (a.allocated_bytes, a.usage(), a.free_slabs) == before
        _check_invariants(a, live)
    # free everything -> back to a fresh allocator
    for off in list(live):
        a.free(off)
    assert (a.allocated_bytes, a.usage(), a.free_slabs) == (0, [], N_SLABS)


@pytest.mark.parametrize("seed", range(40))
def test_allocate_many_and_free_many_end_where_one_at_a_time_ends(seed: int) -> None:
    """allocate_many(size, n) hands out exactly the slots n `allocate` calls would, in that order, and stops where
    they would return None; free_many is `free` of each. Two allocators driven side by side through random
    interleavings (sizes of several classes, two domains, partial and exhausted arenas) stay identical."""
    import random
    rng = random.Random(seed)
    one, many = SlabAllocator(4096, 64 << 20, 4 << 20), SlabAllocator(4096, 64 << 20, 4 << 20)
    held_one: list[int] = []
    held_many: list[int] = []
    for _ in range(300):
        if held_one and rng.random() < 0.4:
            k = rng.randrange(len(held_one))
            n = rng.randint(1, min(6, len(held_one) - k))
            for off in held_one[k:k + n]:
                one.free(off)
            many.free_many(held_many[k:k + n])
            del held_one[k:k + n], held_many[k:k + n]
        else:
            size, n = rng.choice([4096, 5000, 65536, 1 << 20, 2 << 20, 3 << 20]), rng.randint(1, 9)
            domain = rng.choice(["", "tenant-a"])
            got: list[int] = []
            while len(got) < n and (off := one.allocate(size, domain)) is not None:
                got.append(off)
            assert many.allocate_many(size, n, domain) == got
            held_one += got
            held_many += got
        assert (many.allocated_bytes, many.usage(), many.free_slabs, many.domain_slabs()) == \
            (one.allocated_bytes, one.usage(), one.free_slabs, one.domain_slabs())
    assert held_one == held_many


def test_free_many_stops_at_the_first_bad_offset_having_freed_the_ones_before() -> None:
    a = SlabAllocator(4096, 16 << 20, 1 << 20)
    got = a.allocate_many(65536, 3)
    assert got == [4096, 4096 + 65536, 4096 + 2 * 65536] and a.allocated_bytes == 3 * 65536
    with pytest.raises(ValueError, match="not an allocated slot"):
        a.free_many([got[0], got[0] + 1, got[1]])
    assert a.allocated_bytes == 2 * 65536
    a.free_many(got[1:])
    assert a.allocated_bytes == 0 and a.free_slabs == a.n_slabs
