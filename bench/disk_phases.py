"""Where the disk tier's time goes in bench.disk: one instrumented write and read pass per block size (reads on
one thread, so the phases add up to the pass's time).

Outside the medians. Instance attributes shadow the BlockIO and index methods, the store's locks are timed
ones, and the disk modules' `xxhash` name is a timed proxy for the pass, so the real call path is measured.
"""

from __future__ import annotations

import os
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from bench._common import TimedLock, fmt_bytes, gbs, timed
from kvstore.tiers.disk import BlockIO, DiskConfig, DiskStore
from kvstore.tiers.disk import reader as disk_reader
from kvstore.tiers.disk import writer as disk_writer

if TYPE_CHECKING:
    from bench.disk import Passes, Plan

__all__ = ["PHASES", "profile"]

IO_PHASES = {"pwrite": "pwrite/pread", "pread": "pwrite/pread", "fdatasync": "fdatasync", "open": "segment prep",
             "fallocate": "segment prep", "sync_directory": "segment prep"}
PHASES = ("pwrite/pread", "fdatasync", "segment prep", "lmdb", "xxh3", "lock wait")


def profile(root: str, p: Passes, plan: Plan, pg: Any, sizes: Sequence[int],
            config_for: Callable[[str, int], DiskConfig]) -> dict[str, dict[str, float]]:
    """One instrumented write and read pass per size on a fresh store: milliseconds per phase.

    Instance attributes shadow the BlockIO and index methods, the store's locks are timed ones, and the disk
    modules' `xxhash` name is a timed proxy until the end: a benchmark must see the real call path. The lmdb
    phase includes lmdb's own fdatasync of data.mdb (every commit with sync="data")."""
    acc: dict[str, float] = defaultdict(float)
    io = BlockIO()
    for op, phase in IO_PHASES.items():
        setattr(io, op, timed(acc, phase, getattr(io, op)))
    store = DiskStore(config_for(os.path.join(root, "store-profile"), len(sizes) * plan.pass_bytes), io=io)
    locks = TimedLock(acc), TimedLock(acc), TimedLock(acc)
    store._writer_lock, store._mutate, store._lock = locks  # type: ignore[assignment]  # timing proxies stand in for the locks
    store.open()
    index = store._st.index  # type: ignore[union-attr]  # open() has just set _st
    for op in ("commit", "get", "reclaim", "ensure_namespace", "ns_id"):
        setattr(index, op, timed(acc, "lmdb", getattr(index, op)))
    proxy = types.SimpleNamespace(xxh3_64_intdigest=timed(acc, "xxh3", xxhash.xxh3_64_intdigest))
    out: dict[str, dict[str, float]] = {}
    try:
        disk_writer.xxhash = disk_reader.xxhash = proxy  # type: ignore[assignment]  # a timing proxy stands in for xxhash
        for size in sizes:
            pg.step(f"phases of DiskStore, {fmt_bytes(size)} blocks")
            for op, fn in (("write_many", lambda: p.tier_write(store, size, plan.pass_bytes)),
                           ("read_stream", lambda: p.tier_read(store, size, threads=1))):  # one thread: the
                # phases of a read add up to its wall time (the timed passes read on the promoters' threads)
                acc.clear()
                total = fn()
                row = {k: round(acc.get(k, 0.0) * 1e3, 1) for k in PHASES}
                serial = [k for k in PHASES if k != "xxh3"]  # hashed during a pwrite / pread: inside its time
                row["other (Python)"] = round((total - sum(acc.get(k, 0.0) for k in serial)) * 1e3, 1)
                row.update({"total": round(total * 1e3, 1), "GB/s": round(gbs(plan.pass_bytes, total), 3)})
                out[f"{op} {fmt_bytes(size)}"] = row
            pg.advance()
    finally:
        disk_writer.xxhash = disk_reader.xxhash = xxhash
        store.close()
    return out
