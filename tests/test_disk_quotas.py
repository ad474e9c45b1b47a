"""Per-tenant disk quotas in the disk tier (kvstore/tiers/disk/floors.py), on real segment files and lmdb.

Shapes: segments of 1 MiB holding 4 blocks of 256 KiB, capacity 6 segments (24 blocks); quotas may protect at
most capacity - 2 segments = 4 MiB. Namespace "a/x" belongs to tenant a, "b/x" to b, "c/x" to c. Blocks are
written one per batch, so the segment each lands in can be read off the comments.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.tiers.disk import DiskConfig, DiskStatus, DiskStore, TenantFloors, WriteItem
from kvstore.tiers.disk.floors import protect

KiB = 1024
MiB = 1024 * KiB
BLOCK = 256 * KiB
OK = DiskStatus.OK


def _floors(**quotas: int) -> TenantFloors:
    return TenantFloors(tenant_of=lambda ns: ns.split("/", 1)[0], quota_of=lambda t: quotas.get(t, 0))


class Blocks:
    """A page-aligned source and destination buffer; block (ns, i) is a pure function of its name."""

    def __init__(self) -> None:
        self._src_mem = np.empty(BLOCK + 4096, dtype=np.uint8)
        self._dst_mem = np.empty(BLOCK + 4096, dtype=np.uint8)
        self.src = _aligned(self._src_mem)
        self.dst = _aligned(self._dst_mem)

    @staticmethod
    def data(ns: str, i: int) -> bytes:
        seed = sum(ns.encode()) * 1000 + i
        return np.random.default_rng(seed).bytes(BLOCK)

    def write(self, store: DiskStore, ns: str, i: int) -> None:
        self.src[:] = np.frombuffer(self.data(ns, i), dtype=np.uint8)
        res = store.write_batch([WriteItem(ns, b"k%d" % i, self.src.ctypes.data, BLOCK)])
        assert res.statuses == [OK]

    def present(self, store: DiskStore, ns: str, n: int) -> list[int]:
        """Indexes of the blocks of `ns` (0..n-1) the store serves, each checked byte for byte."""
        out = []
        for i in range(n):
            status, length = store.read_into(ns, b"k%d" % i, self.dst.ctypes.data, BLOCK)
            if status == OK:
                assert length == BLOCK and self.dst.tobytes() == self.data(ns, i), (ns, i)
                out.append(i)
        return out


def _aligned(mem: np.ndarray) -> np.ndarray:
    off = (-mem.ctypes.data) % 4096
    return mem[off:off + BLOCK]


def _open(directory: Path, floors: TenantFloors | None) -> DiskStore:
    s = DiskStore(DiskConfig(str(directory), capacity_bytes=6 * MiB, segment_bytes=MiB, sync="none"))
    s.open()
    s.set_floors(floors)
    return s


@pytest.fixture
def blocks() -> Iterator[Blocks]:
    yield Blocks()


def test_a_burst_cannot_evict_a_tenant_at_its_quota(tmp_path: Path, blocks: Blocks) -> None:
    with _open(tmp_path / "d", _floors(a=MiB)) as s:
        for i in range(4):
            blocks.write(s, "a/x", i)            # segment 0, a at its quota
        for i in range(40):                      # b writes 10 MiB through 6 MiB of disk
            blocks.write(s, "b/x", i)
        # segment 0 is reclaimed once (b20): a's 4 blocks are copied back into it, then b's oldest segments go
        assert blocks.present(s, "a/x", 4) == [0, 1, 2, 3]
        assert blocks.present(s, "b/x", 40) == list(range(20, 40))
        assert s.namespace_bytes() == {"a/x": MiB, "b/x": 20 * BLOCK}
        st = s.stats()
        assert (st.quota_kept_blocks, st.reinserted_blocks, st.evicted_blocks, st.quota_overcommitted) == (4, 4, 20, 0)


def test_without_quotas_the_burst_evicts_everything_older(tmp_path: Path, blocks: Blocks) -> None:
    with _open(tmp_path / "d", None) as s:
        for i in range(4):
            blocks.write(s, "a/x", i)
        for i in range(40):
            blocks.write(s, "b/x", i)
        assert blocks.present(s, "a/x", 4) == []
        assert blocks.present(s, "b/x", 40) == list(range(16, 40))
        assert s.namespace_bytes() == {"b/x": 24 * BLOCK}
        assert (s.stats().quota_kept_blocks, s.stats().evicted_blocks) == (0, 20)


def test_a_tenant_over_its_quota_loses_its_oldest_down_to_the_quota(tmp_path: Path, blocks: Blocks) -> None:
    with _open(tmp_path / "d", _floors(a=2 * BLOCK)) as s:
        for i in range(4):
            blocks.write(s, "a/x", i)            # a: 1 MiB, quota 512 KiB
        for i in range(40):
            blocks.write(s, "b/x", i)
        # at segment 0's reclamation a0 and a1 go (a stays >= 512 KiB), a2 and a3 stay
        assert blocks.present(s, "a/x", 4) == [2, 3]
        assert s.namespace_bytes()["a/x"] == 2 * BLOCK
        assert s.stats().quota_kept_blocks == 2


def test_quotas_of_several_tenants_hold_while_a_third_bursts(tmp_path: Path, blocks: Blocks) -> None:
    with _open(tmp_path / "d", _floors(a=MiB, b=2 * BLOCK)) as s:
        for i in range(4):
            blocks.write(s, "a/x", i)
        for i in range(2):
            blocks.write(s, "b/x", i)
        for i in range(60):
            blocks.write(s, "c/x", i)
        assert blocks.present(s, "a/x", 4) == [0, 1, 2, 3]
        assert blocks.present(s, "b/x", 2) == [0, 1]
        ns = s.namespace_bytes()
        assert (ns["a/x"], ns["b/x"]) == (MiB, 2 * BLOCK)
        assert ns["c/x"] <= 6 * MiB - MiB - 2 * BLOCK
        assert blocks.present(s, "c/x", 60) == list(range(60 - ns["c/x"] // BLOCK, 60))


def test_floors_hold_after_a_restart(tmp_path: Path, blocks: Blocks) -> None:
    with _open(tmp_path / "d", _floors(a=MiB)) as s:
        for i in range(4):
            blocks.write(s, "a/x", i)
        for i in range(16):
            blocks.write(s, "b/x", i)
    with _open(tmp_path / "d", _floors(a=MiB)) as s:   # usage per namespace comes back from the index
        assert s.namespace_bytes() == {"a/x": MiB, "b/x": 16 * BLOCK}
        for i in range(16, 56):
            blocks.write(s, "b/x", i)
        assert blocks.present(s, "a/x", 4) == [0, 1, 2, 3]
        assert s.namespace_bytes()["a/x"] == MiB


def test_deletes_and_rewrites_keep_usage_exact(tmp_path: Path, blocks: Blocks) -> None:
    with _open(tmp_path / "d", _floors(a=MiB)) as s:
        for i in range(4):
            blocks.write(s, "a/x", i)
        assert s.delete("a/x", [b"k1"]) == 1
        blocks.write(s, "a/x", 2)                # a rewrite replaces the old record: no double count
        assert s.namespace_bytes() == {"a/x": 3 * BLOCK}
        assert s.clear_namespace("a/x") == 3
        assert s.namespace_bytes() == {}


def test_overcommitted_quotas_fall_back_to_fifo_instead_of_stalling(tmp_path: Path, blocks: Blocks,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with _open(tmp_path / "d", _floors(a=6 * MiB)) as s:     # more than capacity - 2 segments
        for i in range(20):
            blocks.write(s, "a/x", i)            # 5 MiB: a protects 5 MiB > the 4 MiB limit
        for i in range(20):
            blocks.write(s, "b/x", i)            # every write still lands
        # b4 reclaims segment 0 in FIFO order (a's 5 MiB > 4 MiB); from then on a holds 4 MiB = the limit,
        # which is protected again: b lives in the other 2 segments
        st = s.stats()
        assert (st.quota_overcommitted, st.quota_kept_blocks, st.blocks) == (1, 32, 24)
        assert blocks.present(s, "a/x", 20) == list(range(4, 20))
        assert blocks.present(s, "b/x", 20) == list(range(12, 20))
    assert "lower tenant_disk_quota" in caplog.text


def test_protect_walks_oldest_first_and_updates_usage() -> None:
    usage = {"a": 10, "b": 4}
    recs = [(b"1", 1, 3), (b"2", 2, 2), (b"3", 1, 3), (b"4", 1, 3), (b"5", 2, 2)]
    keep = protect(recs, usage, {1: "a", 2: "b"}, {"a": 5, "b": 4}.__getitem__)
    # a: 10-3=7>=5 drop (7), 7-3=4<5 keep, keep; b: 4-2=2<4 keep both
    assert keep == {b"2", b"3", b"4", b"5"}
    assert usage == {"a": 7, "b": 4}
