"""A client refuses any slot a daemon names outside its arena mapping before a byte moves (a wild write
otherwise): kvstore/client/arena_path.py's check, in C, including values no uint64 holds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvstore.arena.layout import ArenaLayout
from kvstore.client.arena_path import SlotWriter, _check_slots, nbytes_of
from kvstore.errors import InvalidRequestError

MIB = 1 << 20


def _mapping() -> Any:
    """What the check reads of an ArenaMap: its layout and base address (no copy is made here)."""
    return SimpleNamespace(layout=ArenaLayout.for_capacity("x", 4 * MIB, MIB), address=1 << 40)


def test_slots_inside_come_back_as_uint64_offsets() -> None:
    m = _mapping()
    lo = m.layout.data_offset
    offs = [lo + i * MIB for i in range(4)]
    got = _check_slots(m, offs, [MIB] * 4)
    assert got.dtype == np.uint64 and got.tolist() == offs


@pytest.mark.parametrize("offset_delta, size, shown", [
    (-4096, 4096, "the region's start - 4096"),
    (MIB - 4096, 8192, "across a slab boundary"),
    (None, 1, "a negative offset"),
    (0, 2**64, "a size past 64 bits"),
])
def test_a_slot_outside_is_refused_naming_it(offset_delta: int | None, size: int, shown: str) -> None:
    m = _mapping()
    lo = m.layout.data_offset
    bad = -5 if offset_delta is None else lo + offset_delta
    offs, sizes = [lo, lo + MIB, bad, lo + 2 * MIB], [MIB, MIB, size, MIB]
    with pytest.raises(InvalidRequestError, match=rf"slot \[{bad}, \+{size}\) is outside the arena's data region"):
        _check_slots(m, offs, sizes)
    if size < 2**32:  # a writer takes the sizes from its values
        with pytest.raises(InvalidRequestError, match="outside the arena's data region"):
            SlotWriter(m, offs, [np.zeros(z, np.uint8) for z in sizes])


def test_nbytes_of_answers_what_memoryview_does_for_every_kind_of_value() -> None:
    """A plain numpy array answers from its shape (no buffer export); anything else through memoryview, which
    still refuses a value that is no buffer at all."""
    class Sub(np.ndarray):  # a subclass may define its own buffer: asked through memoryview
        pass

    base = np.arange(4096, dtype=np.uint16)
    values: list[object] = [np.zeros(3 * MIB, np.uint8), base.reshape(64, 64), base[::2], np.zeros(0, np.uint8),
                            np.zeros(5, np.float64).view(Sub), b"abc", bytearray(7), memoryview(b"0123456789")[2:5]]
    assert nbytes_of(values) == [memoryview(v).nbytes for v in values] == [3 * MIB, 8192, 4096, 0, 40, 3, 7, 3]
    with pytest.raises(TypeError):
        nbytes_of([b"ok", 12345])


def test_a_writer_given_the_lengths_checks_its_slots_with_them() -> None:
    m = _mapping()
    lo = m.layout.data_offset
    values = [np.zeros(MIB, np.uint8), np.zeros(MIB, np.uint8)]
    with pytest.raises(InvalidRequestError, match=rf"slot \[{lo + MIB}, \+{MIB + 1}\) is outside"):
        SlotWriter(m, [lo, lo + MIB], values, 1, [MIB, MIB + 1])
