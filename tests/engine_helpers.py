"""The default rig of the RAM-tier engine tests (tests/test_engine*.py): the engine built from its real small
parts (layout math, a numpy generation table, a slab allocator, a policy), and the calls the scripts repeat.

Default rig: 4 MiB of data in 1 MiB slabs (4 slabs; max_block_bytes = slab), data at DO = 2 MiB, so slab i
starts at DO + i MiB and its generation sits at index i * 256 of the table. Times are explicit: `later(s)` is a
monotonic time to pass to `sweep(now=...)` instead of sleeping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.results import RESERVED, EngineConfig
from kvstore.policies import make_policy

__all__ = ["KiB", "MiB", "DO", "NS", "NO_WATERMARKS", "Rig", "make_rig", "put", "touch", "present", "later"]

KiB = 1024
MiB = 1024 * KiB
DO = 2 * MiB  # data offset of every arena below 512 GiB
NS = "m@1/default"
NO_WATERMARKS = {"high_watermark": 1.0, "low_watermark": 1.0}


@dataclass
class Rig:
    engine: Engine
    alloc: SlabAllocator
    gens: np.ndarray
    layout: ArenaLayout

    def gen_at(self, offset: int) -> int:
        return int(self.gens[self.layout.generation_index(offset)])


def make_rig(
    data_bytes: int = 4 * MiB, max_block: int = 1 * MiB, policy: str = "lru", **cfg: float | int
) -> Rig:
    layout = ArenaLayout.for_capacity("x", data_bytes, max_block)
    gens = np.zeros(layout.gen_table_bytes // 8, dtype=np.uint64)
    alloc = SlabAllocator(layout.data_offset, layout.data_bytes, max_block)
    engine = Engine(EngineConfig(max_block_bytes=max_block, **cfg), layout, gens, alloc, make_policy(policy))
    assert engine.register_namespace(NS) is True
    return Rig(engine, alloc, gens, layout)


def put(eng: Engine, keys: list[bytes], size: int = 1 * MiB, ns: str = NS) -> list[int]:
    """Reserve and commit `keys` (all new); the offsets they got."""
    r = eng.reserve(ns, keys, [size] * len(keys))
    assert r.outcomes == [RESERVED] * len(keys)
    assert eng.commit(r.reservation_id) == len(keys)
    return r.offsets


def touch(eng: Engine, *keys: bytes) -> None:
    """An access without a lease (refreshes recency only)."""
    assert eng.lookup(NS, list(keys), lease=False).present == [True] * len(keys)


def present(eng: Engine, keys: list[bytes]) -> list[bool]:
    return eng.exists(NS, keys)


def later(seconds: float) -> float:
    """A monotonic time `seconds` from now (what sweep compares deadlines with)."""
    return time.monotonic() + seconds

