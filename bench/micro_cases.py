"""bench.micro's workloads: unique chain-hash keys, pre-faulted buffers, the copy limit's cases, put and get cases
of the client, the arena fill, and the daemon-RSS-per-block run.

Why a module of their own: they are what every section of bench.micro measures with, while bench/micro.py keeps
the plan, the sections and the report; each piece here checks that it did what it says (a put of fresh keys
stores them all, a get of stored keys misses none), so a benchmark of nothing fails instead of reporting.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bench._common import Case
from bench.copy_limit import LIMIT_THREADS, Addrs, addrs, native_cases
from bench.micro_phases import rss_anon
from kvstore.client import Client
from kvstore.testing import DaemonProcess

__all__ = ["KIB", "MIB", "RSS_BLOCK", "RSS_BATCH", "keygen", "take", "faulted", "limit_cases", "fill_arena",
           "put_case", "get_case", "bench_rss"]

KIB, MIB = 1 << 10, 1 << 20
RSS_BLOCK, RSS_BATCH = 4 * KIB, 4096


def keygen(tag: str) -> Iterator[bytes]:
    """Unique 32-byte keys shaped like the sha256 chain hashes the connector uses."""
    for i in itertools.count():
        yield hashlib.sha256(f"{tag}/{i}".encode()).digest()


def take(keys: Iterator[bytes], n: int) -> list[bytes]:
    return list(itertools.islice(keys, n))


def faulted(nbytes: int, fill: int = 1) -> np.ndarray:
    """A buffer whose pages are already touched: first touch would measure the kernel's page allocator."""
    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(fill)
    return a


def limit_cases(size: int, batch: int) -> dict[str, Case]:
    """The copy limit (bench/copy_limit.py) of B blocks into a rotating ring of cold destinations; each thread
    count has its own sources (run back to back, the second would read what the first pulled into the cache)."""
    ring = [faulted(size, 0) for _ in range(max(batch, math.ceil(128 * MIB / size)))]
    pos = itertools.count()

    def rotating(srcs: list[np.ndarray]) -> Callable[[], Addrs]:
        def next_addrs() -> Addrs:
            start = next(pos) * batch
            return addrs([ring[(start + j) % len(ring)] for j in range(batch)], srcs)
        return next_addrs
    cases: dict[str, Case] = {}
    for t in LIMIT_THREADS:
        cases.update(native_cases(rotating([faulted(size, (i + t) % 251) for i in range(batch)]), threads=(t,)))
    return cases


def fill_arena(c: Client, ns: str, size: int, arena_bytes: int) -> None:
    """Put 1.25 arena's worth of fresh blocks so the timed puts run in steady-state eviction (a serving cache is
    full: every real put pays for the victims it displaces). Batches of at most a quarter of the arena: the
    measured clients' connections hold spare slots (kvstore/engine/spares.py), so one batch the size of the
    whole arena would not fit."""
    keys, value = keygen(f"fill{size}"), faulted(size, 7)
    per = max(1, min(256, (64 * MIB) // size, arena_bytes // 4 // size))
    for _ in range(math.ceil(1.25 * arena_bytes / size / per)):
        c.put_many(ns, take(keys, per), [value] * per)


def put_case(c: Client, ns: str, values: list[np.ndarray], tag: str) -> Case:
    """put_many of fresh keys; one value is client.put, the single-block call."""
    keys = keygen(tag)

    def put(ks: list[bytes]) -> None:
        stored = int(c.put(ns, ks[0], values[0])) if len(ks) == 1 else c.put_many(ns, ks, values).stored
        if stored != len(ks):
            raise RuntimeError(f"put of {len(ks)} fresh keys ({c.control_path}) stored {stored}")
    return Case(put, lambda: take(keys, len(values)))


def get_case(c: Client, ns: str, keys: list[bytes], bufs: list[np.ndarray]) -> Case:
    """get_many_into of stored keys; one key is client.get_into, the single-block call."""
    def get(_: object) -> None:
        got = [c.get_into(ns, keys[0], bufs[0])] if len(keys) == 1 else c.get_many_into(ns, keys, bufs)
        if None in got:
            raise RuntimeError(f"get ({c.control_path}) missed {got.count(None)} of {len(keys)} stored keys")
    return Case(get)


def bench_rss(n: int) -> dict[str, Any]:
    """RssAnon growth of a daemon per cataloged block (the catalog's budget is <= 256 B a block)."""
    arena = math.ceil((n + RSS_BATCH) * RSS_BLOCK / 0.85 / (1 << 30)) << 30  # stay under the 0.95 watermark
    value, keys = faulted(RSS_BLOCK, 3), keygen("rss")
    # the daemon pre-faults the whole arena before it answers: on a VM whose host hands memory back (free page
    # reporting), 5 GiB took 28 s here; allow 10 s a GiB
    daemon = DaemonProcess(arena_bytes=arena, max_block_bytes="64KiB")
    with contextlib.closing(daemon.start(timeout_s=20 + 10 * (arena >> 30))) as d, Client(d.address) as c:
        assert c.mode == "arena", c.mode
        c.register_namespace("rss")
        c.put_many("rss", take(keys, RSS_BATCH), [value] * RSS_BATCH)  # warm every code path and buffer first
        time.sleep(0.3)
        assert d.proc is not None
        before = rss_anon(d.proc.pid)
        t0 = time.perf_counter()
        for done in range(0, n, RSS_BATCH):
            k = min(RSS_BATCH, n - done)
            if c.put_many("rss", take(keys, k), [value] * k).stored != k:
                raise RuntimeError("RSS run: a put of fresh keys was not stored")
        put_s = time.perf_counter() - t0
        time.sleep(0.3)
        after = rss_anon(d.proc.pid)
        st = c.stats()
        if st.blocks != n + RSS_BATCH or st.counters.get("evictions", 0):
            raise RuntimeError(f"RSS run: expected {n + RSS_BATCH} blocks and no evictions, got {st.blocks}, "
                               f"{st.counters.get('evictions')}")
    return {"n_blocks_rss": n, "bytes_per_block": round((after - before) / n, 1), "rss_anon_before_mib":
            round(before / MIB, 1), "rss_anon_after_mib": round(after / MIB, 1), "rss_arena_bytes": arena,
            "rss_put_blocks_per_s": round(n / put_s)}
