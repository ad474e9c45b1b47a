"""The rig of the engine's RAM + disk tests (tests/test_engine_tiering*.py): a real DiskStore in tmp_path, a
real (anonymous, page-aligned) mapping as the arena, the real Mover threads.

Rig: 4 slabs of 64 KiB (4 blocks of BLOCK bytes; max_block_bytes = slab), no watermark eviction, so a block
leaves RAM only when a reserve or promotion needs its slot. disk_write is `commit` unless a test asks for
`evict` (write_mode); a write budget may be given. Disk: 4 MiB in 1 MiB segments, sync="none".
Block contents are a pure function of the key (value). Background work is awaited by polling with a deadline
(wait_until), never by sleeping. A test module makes its fixture with `make_rig = rig_fixture()`.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.results import RESERVED, EngineConfig, LookupResult
from kvstore.policies import make_policy
from kvstore.policies.admission import make_admission
from kvstore.policies.write_budget import WriteBudget
from kvstore.testing import wait_until
from kvstore.testing.gated_io import GatedIO
from kvstore.tiers.disk import AlignedBuffer, DiskConfig, DiskStatus, DiskStore, WriteItem

__all__ = ["KiB", "MiB", "BLOCK", "NS", "RAM", "DISK", "NONE", "value", "Rig", "rig_fixture"]

KiB, MiB = 1024, 1024 * 1024
BLOCK = 64 * KiB
NS = "m@1/tiering"
RAM, DISK, NONE = 1, 2, 0


def value(key: bytes) -> bytes:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return random.Random(seed).randbytes(BLOCK)


@dataclass
class Rig:
    engine: Engine
    disk: DiskStore
    io: GatedIO
    mm: mmap.mmap

    def put(self, keys: list[bytes]) -> list[int]:
        """Reserve, copy each block's bytes into its slot, commit; the offsets."""
        r = self.engine.reserve(NS, keys, [BLOCK] * len(keys))
        assert r.outcomes == [RESERVED] * len(keys)
        for k, off in zip(keys, r.offsets):
            self.mm[off: off + BLOCK] = value(k)
        assert self.engine.commit(r.reservation_id) == len(keys)
        return r.offsets

    def put_disk_only(self, keys: list[bytes]) -> None:
        """Write blocks straight into the disk tier (the engine never had them in RAM)."""
        buf = AlignedBuffer(BLOCK)
        try:
            for k in keys:
                buf.view(BLOCK)[:] = value(k)
                assert self.disk.write_many([WriteItem(NS, k, buf.address, BLOCK)]) == [DiskStatus.OK]
        finally:
            buf.close()

    def read(self, res: LookupResult, j: int) -> bytes:
        off, size = res.offsets[j], res.sizes[j]
        return bytes(self.mm[off: off + size])

    def counter(self, name: str) -> int:
        return self.engine.stats().counters[name]

    def wait_written(self, n: int) -> None:
        """Wait until the writer has finished `n` writes in all (and released their slot holds)."""
        wait_until(lambda: self.counter("disk_writes") == n and self.engine.stats().leased_bytes == 0
                   and self.engine.write_queue_blocks == 0, timeout_s=10, what=f"{n} disk writes")

    def leases(self, keys: list[bytes]) -> list[int]:
        return [r.leases for r in self.engine.describe(NS, keys)]



def rig_fixture() -> Callable[..., Any]:
    """`make_rig = rig_fixture()` in a test module: a Rig factory fixture; every rig is stopped and its store
    closed at the end (a rig may be made twice on one dir)."""

    @pytest.fixture
    def make_rig(tmp_path) -> Iterator[Callable[..., Rig]]:
        made: list[Rig] = []

        def make(admission: str = "always", start: bool = True, register: bool = True, disk_bytes: int = 4 * MiB,
                 reinsert_hits: int = 1, write_mode: str = "commit", budget: WriteBudget | None = None,
                 promote_timeout_s: float = 5.0) -> Rig:
            io = GatedIO()
            disk = DiskStore(DiskConfig(directory=str(tmp_path / "disk"), capacity_bytes=disk_bytes,
                                        segment_bytes=MiB, sync="none", reinsert_hits=reinsert_hits), io=io)
            disk.open()
            layout = ArenaLayout.for_capacity("x", 4 * BLOCK, BLOCK)
            mm = mmap.mmap(-1, layout.size_bytes)  # anonymous: page-aligned, zeroed
            anchor = (ctypes.c_char * 1).from_buffer(mm)
            address = ctypes.addressof(anchor)
            del anchor
            gens = np.frombuffer(mm, dtype=np.uint64, count=layout.gen_table_bytes // 8)
            engine = Engine(EngineConfig(max_block_bytes=BLOCK, high_watermark=1.0, low_watermark=1.0,
                                         promote_timeout_s=promote_timeout_s), layout,
                            gens, SlabAllocator(layout.data_offset, layout.data_bytes, BLOCK), make_policy("lru"),
                            disk=disk, admission=make_admission(admission), arena_address=address,
                            write_mode=write_mode, budget=budget)
            if register:
                assert engine.register_namespace(NS) is True
            if start:
                engine.start()
            made.append(Rig(engine, disk, io, mm))
            return made[-1]

        yield make
        for rig in made:
            rig.io.gate.set()
            rig.engine.stop()
            rig.disk.close()
    return make_rig
