"""The native copy plan (kvstore._native.plan_pieces, plan.c) and where a copy's helper threads may run
(copy_core.c): exact entries against the arithmetic they replace, every refusal, and the thread rules."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvstore._native import _copy, plan_pieces

MiB = 1 << 20


def _pieces(rng: np.random.Generator, count: int) -> tuple[np.ndarray, ...]:
    base = rng.integers(1 << 30, 1 << 40, size=count, dtype=np.uint64)
    stride = rng.integers(1, 1 << 20, size=count, dtype=np.uint64)
    nbytes = rng.integers(1, 1 << 16, size=count, dtype=np.uint64)
    offset = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.uint64)
    return base, stride, offset, nbytes


def _reference(slots: np.ndarray, blocks: np.ndarray, pieces: tuple[np.ndarray, ...], block_bytes: int,
               to_store: bool) -> tuple[list[int], list[int], list[int]]:
    """The plan one entry at a time, as its docstring states it."""
    base, stride, offset, nbytes = pieces
    dst, src, lengths = [], [], []
    for s, row in enumerate(blocks):
        for j, b in enumerate(row):
            if b < 0:
                continue
            for p in range(len(base)):
                cache = int(base[p]) + int(b) * int(stride[p])
                slot = int(slots[s]) + j * block_bytes + int(offset[p])
                d, c = (slot, cache) if to_store else (cache, slot)
                dst.append(d)
                src.append(c)
                lengths.append(int(nbytes[p]))
    return dst, src, lengths


def _outputs(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.full(n, 7, dtype=np.uint64) for _ in range(3))  # type: ignore[return-value]


@pytest.mark.parametrize("to_store", [True, False])
@pytest.mark.parametrize("per_slot", [1, 3])
def test_plan_entries_equal_the_stated_arithmetic(to_store: bool, per_slot: int) -> None:
    rng = np.random.default_rng(per_slot)
    pieces = _pieces(rng, 64)
    block_bytes = int(pieces[3].sum())
    slots = rng.integers(1 << 41, 1 << 42, size=32, dtype=np.uint64)
    blocks = rng.integers(0, 1000, size=(32, per_slot), dtype=np.int64)
    blocks[5, 0] = blocks[20, per_slot - 1] = -1  # left untouched: no entries
    out = _outputs(blocks.size * 64 + 5)
    n = plan_pieces(slots, blocks.reshape(-1), per_slot, pieces, block_bytes, 1000, to_store, out)
    dst, src, lengths = _reference(slots, blocks, pieces, block_bytes, to_store)
    assert n == len(dst) == (blocks.size - 2) * 64
    assert (out[0][:n].tolist(), out[1][:n].tolist(), out[2][:n].tolist()) == (dst, src, lengths)
    assert all(o[n:].tolist() == [7] * (len(o) - n) for o in out)  # nothing written past the entries


def test_a_block_id_out_of_range_is_refused_before_anything_is_written() -> None:
    pieces = _pieces(np.random.default_rng(0), 4)
    slots = np.array([1 << 41, 1 << 42], dtype=np.uint64)
    for bad in (10, -2):
        out = _outputs(8)
        with pytest.raises(ValueError, match=rf"block id out of range \[0, 10\): {bad}"):
            plan_pieces(slots, np.array([3, bad], dtype=np.int64), 1, pieces, 100, 10, True, out)
        assert all(o.tolist() == [7] * 8 for o in out)


def test_mismatched_arguments_are_refused_with_their_counts() -> None:
    pieces = _pieces(np.random.default_rng(1), 4)
    slots = np.array([1 << 41, 1 << 42], dtype=np.uint64)
    blocks = np.array([1, 2], dtype=np.int64)
    with pytest.raises(ValueError, match="2 block ids for 2 slots of 2 blocks each"):
        plan_pieces(slots, blocks, 2, pieces, 100, 10, True, _outputs(16))
    with pytest.raises(ValueError, match="piece arrays of unequal length"):
        plan_pieces(slots, blocks, 1, (*pieces[:3], pieces[3][:3]), 100, 10, True, _outputs(8))
    with pytest.raises(ValueError, match="outputs of 7, 7 and 7 entries for 2 blocks of 4 pieces"):
        plan_pieces(slots, blocks, 1, pieces, 100, 10, True, _outputs(7))
    with pytest.raises(ValueError, match="2 block ids for 2 slots of 4611686018427387905 blocks each"):
        plan_pieces(slots, blocks, 2**62 + 1, pieces, 100, 10, True, _outputs(8))  # 2 x that wraps to 2
    with pytest.raises(TypeError, match="blocks must be a 1-D array of int64"):
        plan_pieces(slots, blocks.astype(np.uint64), 1, pieces, 100, 10, True, _outputs(8))
    with pytest.raises(TypeError, match="slots must be a 1-D array of uint64"):
        plan_pieces(slots.astype(np.int64), blocks, 1, pieces, 100, 10, True, _outputs(8))
    read_only = _outputs(8)
    read_only[1].flags.writeable = False
    with pytest.raises(TypeError, match="src must be a writable"):
        plan_pieces(slots, blocks, 1, pieces, 100, 10, True, read_only)


# ------------------------------------------------------------------------------ a copy's threads and their CPUs

def _in_thread_pinned(cpus: set[int], fn):  # type: ignore[no-untyped-def]
    """fn() on a new thread bound to `cpus` (this thread's affinity is left alone)."""
    got: list[object] = []

    def run() -> None:
        os.sched_setaffinity(0, cpus)
        got.append(fn())
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return got[0]


needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="the helper-placement rules need a process allowed on two or more CPUs")


@needs_two_cpus
def test_helper_threads_run_off_the_callers_cpu() -> None:
    """The helper of a 2-thread copy may run on every allowed CPU but the caller's (copy_core.c says why)."""
    two = set(sorted(os.sched_getaffinity(0))[:2])
    threads, cpus = _in_thread_pinned(two, lambda: _copy._threads_for(2, 64 * MiB))
    assert threads == 2 and len(cpus) == 1 and set(cpus) < two


@needs_two_cpus
def test_no_more_threads_than_allowed_cpus() -> None:
    one = {min(os.sched_getaffinity(0))}
    assert _in_thread_pinned(one, lambda: _copy._threads_for(2, 64 * MiB)) == (1, [])
    two = set(sorted(os.sched_getaffinity(0))[:2])
    assert _in_thread_pinned(two, lambda: _copy._threads_for(8, 1 << 40))[0] == 2


def test_small_copies_start_no_thread() -> None:
    """Under 12 MiB a thread (min_share) a copy stays on the caller's thread, and nothing is restricted."""
    assert _copy._threads_for(2, 8 * MiB) == (1, [])
    assert _copy._threads_for(1, 1 << 40) == (1, [])
