"""The Mover's promoters read their queue as a stream (DiskStore.read_stream): every promotion is reported
exactly once (cancelled ones as misses, without a read), with its verified bytes, and a hook that raises does
not stop the promoters. A real DiskStore and a recording hooks double drive it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kvstore.engine.movement import Mover, Promotion
from kvstore.tiers.disk import DiskStatus, DiskStore, WriteItem
from tests.disk_store_helpers import NOT_FOUND, OK, Buf, KiB, MiB, cfg, random_bytes, write

SLOT = 256 * KiB


class Hooks:
    """MoverHooks that records each finished promotion; `fail_eid`'s report raises (after it was recorded)."""

    def __init__(self, fail_eid: int = -1) -> None:
        self.finished: list[tuple[int, DiskStatus]] = []
        self.lock = threading.Lock()
        self.fail_eid = fail_eid

    def claim_writes(self, batch: list[tuple[int, int, bytes]]) -> tuple[list[WriteItem], list[int]]:
        return [], []

    def finish_writes(self, eids: list[int], statuses: list[DiskStatus]) -> list[tuple[str, bytes]]:
        return []

    def finish_reclaim(self, dropped: list[tuple[str, bytes]], reinserted: int) -> None:
        pass

    def finish_promotion(self, p: Promotion, status: DiskStatus) -> None:
        with self.lock:
            self.finished.append((p.eid, status))
        p.done.set()
        if p.eid == self.fail_eid:
            raise RuntimeError(f"the engine failed on promotion {p.eid}")


def run(tmp_path: Path, hooks: Hooks, keys: list[bytes], cancelled: set[int]) -> tuple[list[Promotion], Buf]:
    s = DiskStore(cfg(tmp_path / "d"))
    s.open()
    blocks = {b"a": random_bytes(100 * KiB, 1), b"b": random_bytes(200 * KiB, 2)}
    assert write(s, Buf(MiB), "ns", blocks) == [OK, OK]
    dest = Buf(SLOT * len(keys))
    dest.arr[:] = 0xAB
    ps = [Promotion(i, "ns", k, dest.address + i * SLOT, SLOT, cancelled=i in cancelled) for i, k in enumerate(keys)]
    mover = Mover(s, hooks)
    mover.enqueue_promotions(ps)   # queued before the promoters start: they take them as one stream each
    mover.start()
    try:
        assert all(p.done.wait(10) for p in ps)
    finally:
        mover.stop()
        s.close()
    for i, k in enumerate(keys):
        if (i, OK) in hooks.finished:
            assert dest.get(len(blocks[k]), i * SLOT) == blocks[k]
    return ps, dest


def test_every_promotion_is_reported_once_cancelled_ones_as_misses_without_a_read(tmp_path: Path) -> None:
    hooks = Hooks()
    keys = [b"a", b"b", b"gone", b"a", b"b", b"a"]
    run(tmp_path, hooks, keys, cancelled={0, 4})
    assert sorted(hooks.finished) == [(0, NOT_FOUND), (1, OK), (2, NOT_FOUND), (3, OK), (4, NOT_FOUND), (5, OK)]


def test_a_report_that_raises_does_not_stop_the_promoters(tmp_path: Path) -> None:
    hooks = Hooks(fail_eid=1)
    keys = [b"a", b"b", b"a", b"b", b"a", b"b", b"a", b"b"]
    run(tmp_path, hooks, keys, cancelled=set())
    assert sorted(hooks.finished) == [(i, OK) for i in range(8)]
