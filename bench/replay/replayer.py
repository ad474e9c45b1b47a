"""Replay a trace through the REAL daemon with the REAL client, the way a vLLM connector drives the store.

Per request, in arrival order (as fast as the store answers; arrival times shape only the capacity model):
  1. lookup(keys, prefix, no lease) -- what lookup_prefix sends: the scheduler side asks how many leading
     blocks are stored; the answer's per-key tiers say which of them are on disk only (their promotion starts);
  2. get_many_into(hit keys, preallocated rows): the worker side loads them (lease -> copy -> release) and the
     replay checks each block's key marks, trusting the chain only up to the first bad block;
  3. put_many(the missed keys, stamped rows): the worker side saves the blocks it computed.
The hit of a request is the number of verified loaded blocks: the store's measured hit, to compare with the
simulator's request by request.

Sync points, each making the daemon's result independent of thread timing (so store == simulation exactly):
- leases: the client releases leases asynchronously, so a put may run while the blocks it just loaded are
  still leased and unevictable. Those blocks are the most recent ones, so this can change a victim only when a
  request's blocks fill most of the RAM tier. There (capacity under 4 of the largest request) the replay waits
  between a load and its put until the daemon holds no lease. This is also the realistic order: in vLLM the
  prefill compute sits between the load and the put, so the releases have long landed.
- promotions (disk tier): after a probe that found blocks on disk only, wait until they have landed in RAM
  before the get. Otherwise a promotion still in flight when the get looks joins it and is inserted into the
  LRU at completion, after the get's touches, in the two promoter threads' finishing order. In vLLM the
  scheduler's probe runs a step before the worker's load, so the prefetch has usually landed too.
- write-behind (disk tier): after each request, wait until the disk writer has written every block queued
  and no lease is held ("synced_writes"). Otherwise a block whose write is in flight is held (not evictable),
  and a next lookup could race with a write batch that reclaims the oldest segment. One Stats call answers
  both; its cost is measured (`settle_s`) and reported. Under disk_write = commit with admission seen:N, hits
  queue writes too: the replay also waits for them before the put (a block being written is not evictable).
  Under disk_write = evict a put's victims are written inside the put (the Reserve waits for them) and a
  probe's promotions are read after the writes their room needed (promotions.py), so no other wait is needed.
- misses (miss_check.py): the daemon's misses_* counters are read before and after the run; the replay counts
  the prefix Lookups that stopped short (`short_lookups`: at most one a request, its probe) to check them by.
- hints (`hints=True`, hints.py): before a request's probe, the ends of Retains its timestamp passed; after its
  put (and the sync points above), the request's own hints, each one Client.hint call, in the order the model
  applies them. A hint is answered under the daemon's lock, so it needs no sync point of its own.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.replay.hints import HintFeed, Send
from bench.replay.keys import chain_keys, stamp, verify
from bench.replay.miss_check import miss_deltas
from bench.replay.tiers import StoreSpec
from bench.replay.trace import Convention, Request
from kvstore.client import Client
from kvstore.client.types import Stats
from kvstore.errors import StoreFullError
from kvstore.testing import DaemonProcess, wait_until
from kvstore.vocab import Tier

__all__ = ["ReplayResult", "replay", "wait_for_leases", "memcpy_gbps"]

NAMESPACE = "replay"
SYNC_BELOW_REQUESTS = 4
WRITE_S_PER_32K = 0.00025  # the disk writer's best case here (O_DIRECT, no fsync): where polling starts
DISK_STATS = ("blocks", "used_bytes", "capacity_bytes", "segments_total", "segments_free", "bytes_written",
              "bytes_read", "evicted_blocks", "evicted_bytes", "io_errors", "checksum_failures")


@dataclass
class ReplayResult:
    hits: list[int]
    disk_hits: list[tuple[int, ...]] = field(default_factory=list)  # per request: hit positions found on disk
    loaded_bytes: int = 0
    stored_bytes: int = 0
    stored_blocks: int = 0
    present_on_put: int = 0
    store_full: int = 0
    verify_failures: int = 0
    lookup_s: float = 0.0
    get_s: float = 0.0
    put_s: float = 0.0
    settle_s: float = 0.0  # waiting for promotions, the disk writer and lease releases (disk tier only)
    settle_polls: int = 0
    wall_s: float = 0.0
    resident_blocks: int = 0
    synced_leases: bool = False
    synced_writes: bool = False
    counters: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)  # the disk tier's Stats at the end (empty without one)
    hint_outcomes: dict[str, int] = field(default_factory=dict)  # hint_<action>_<outcome> -> keys, as answered
    hint_s: float = 0.0
    short_lookups: int = 0  # prefix Lookups that stopped short (miss_check.py: what the daemon counts a cause for)
    misses_by_cause: dict[str, int] = field(default_factory=dict)  # the daemon's misses_* counters, run deltas


class _Rows:
    """A reusable (n, block_bytes) uint8 array: the preallocated KV buffers of a worker, grown on demand."""

    def __init__(self, block_bytes: int, rows: int = 64) -> None:
        self._a = np.zeros((rows, block_bytes), dtype=np.uint8)

    def take(self, n: int) -> np.ndarray:
        if n > len(self._a):
            self._a = np.zeros((max(n, 2 * len(self._a)), self._a.shape[1]), dtype=np.uint8)
        return self._a[:n]


class _Settle:
    """The disk tier's sync points (see the module docstring), polled through Stats and timed.

    A Stats call costs ~3 ms of the daemon's CPU (two cores here, shared with the writer thread), and the
    writer needs >= ~0.25 ms a 32 KiB block, so polling right after a put mostly slows the writer down: the
    first poll waits for the fastest plausible write time of the blocks, then polls come every 2 ms.
    """

    def __init__(self, client: Client, res: ReplayResult, block_bytes: int, timeout_s: float = 30.0) -> None:
        self._client, self._res, self._timeout = client, res, timeout_s
        self._min_write_s = WRITE_S_PER_32K * block_bytes / 32768

    def _wait(self, ready: Callable[[Stats], bool], what: str, first_s: float = 0.0) -> None:
        t0 = time.perf_counter()
        if first_s > 0:
            time.sleep(first_s)

        def check() -> bool:
            self._res.settle_polls += 1
            return ready(self._client.stats())

        wait_until(check, timeout_s=self._timeout, interval_s=0.002, what=what)
        self._res.settle_s += time.perf_counter() - t0

    def promotions(self) -> None:
        # none in flight (reading, queued, or waiting for room), and, with one slot per slab of exactly one
        # block, allocated == stored once no slot is held by a promotion
        self._wait(lambda s: s.disk is not None and s.disk.promotion_queue_blocks == 0
                   and s.allocated_bytes == s.stored_bytes, "the probe's promotions to land")

    def writes(self, blocks: int) -> None:
        self._wait(_written, "the disk writer to drain and the leases to be released", blocks * self._min_write_s)


def _written(s: Stats) -> bool:
    c = s.counters  # every block queued for the writer was written, failed, or dropped at its claim
    done = c["disk_writes"] + c["disk_write_failures"] + c["demote_dropped"]
    return (s.disk is not None and s.disk.write_queue_blocks == 0 and done >= c["disk_writes_queued"]
            and s.leases_active == 0)


def replay(requests: Sequence[Request], spec: StoreSpec, *, convention: Convention = Convention.FULL_BLOCKS,
           on_request: Callable[[], None] | None = None, sync_leases: bool | None = None,
           hints: bool = False,
           watch: Callable[[Client], Callable[[Client], None]] | None = None) -> ReplayResult:
    """Start a daemon sized by `spec`, replay `requests` through it, stop it; the measured result.

    sync_leases: wait between each load and its put until the daemon holds no lease. None = only where it can
    change a victim, i.e. when the RAM tier holds fewer than `SYNC_BELOW_REQUESTS` of the largest request.
    With a disk tier the replay also waits for promotions and for the disk writer (always: see above).
    hints: send the requests' hints (see above; the daemon must answer Client.hint).
    watch: called with the client before the first request; what it returns is called with the client after
    the run's final Stats (landing.py reads the event stream this way).
    """
    largest = max((len(r.cacheable_ids(convention)) for r in requests), default=0)
    if sync_leases is None:
        sync_leases = spec.tiers[0].capacity_blocks < SYNC_BELOW_REQUESTS * largest
    # spare slots off: they would hold arena slots outside the cache the model simulates (kvstore/engine/spares.py)
    with DaemonProcess(**spec.daemon_options()) as daemon, daemon.client(spare_slots=False) as client:
        client.register_namespace(NAMESPACE, model="trace-replay", layout_digest=f"bpt{spec.bytes_per_token}")
        if largest > client.max_batch_keys:  # the client splits such a request into calls the model does not split
            print(f"note: a request of {largest} blocks exceeds the daemon's max_batch_keys "
                  f"({client.max_batch_keys}); the simulation may differ on it", file=sys.stderr)
        finish = watch(client) if watch is not None else None
        sync = (lambda: wait_for_leases(client)) if sync_leases else None
        before = dict(client.stats().counters)
        hit_writes = spec.disk is not None and spec.disk_write == "commit" and spec.disk_admission != "always"
        result = _run(client, requests, spec.block_bytes, convention, on_request, sync, disk=spec.disk is not None,
                      feed=HintFeed() if hints else None, hit_writes=hit_writes)
        stats = client.stats()
        if finish is not None:
            finish(client)
        result.resident_blocks = stats.blocks
        result.counters = dict(stats.counters)
        result.misses_by_cause = miss_deltas(before, result.counters)
        if stats.disk is not None:
            result.disk = {k: int(getattr(stats.disk, k)) for k in DISK_STATS}
        result.synced_leases = sync_leases
    return result


def wait_for_leases(client: Client, timeout_s: float = 10.0) -> None:
    """Block until the client's background releases have reached the daemon (an explicit sync point)."""
    wait_until(lambda: client.stats().leases_active == 0, timeout_s=timeout_s, interval_s=0.001,
               what="the replay's leases to be released")


def _probe(client: Client, keys: Sequence[bytes]) -> tuple[int, tuple[int, ...], int]:
    """client.lookup_prefix (same RPCs, same chunks), also returning which hit positions are on disk only and
    how many of its prefix Lookups stopped short (0 or 1: the probe stops at the first short chunk)."""
    n, on_disk = 0, []
    step = client.max_batch_keys
    for start in range(0, len(keys), step):
        part = list(keys[start:start + step])
        r = client.lookup(NAMESPACE, part, prefix=True, lease=False)
        on_disk += [start + i for i, t in enumerate(r.tiers[:r.num_prefix]) if t == Tier.DISK]
        n += r.num_prefix
        if r.num_prefix < len(part):
            return n, tuple(on_disk), 1
    return n, tuple(on_disk), 0


def _run(client: Client, requests: Sequence[Request], block_bytes: int, convention: Convention,
         on_request: Callable[[], None] | None = None, after_load: Callable[[], None] | None = None,
         *, disk: bool = False, feed: HintFeed | None = None, hit_writes: bool = False) -> ReplayResult:
    """The loop; `after_load` is a sync point between a request's load and its put (tests wait there for the
    background lease releases, which makes the run exact at any capacity); `hit_writes`: hits may queue disk
    writes (commit with seen:N), waited for before the put."""
    res = ReplayResult(hits=[], synced_writes=disk)
    settle = _Settle(client, res, block_bytes) if disk else None
    get_rows, put_rows = _Rows(block_bytes), _Rows(block_bytes)
    clock = time.perf_counter
    start = clock()
    for r in requests:
        if feed is not None:
            _send(client, feed.before(r), res)
        keys = chain_keys(r.cacheable_ids(convention))
        t0 = clock()
        n, on_disk, short = _probe(client, keys) if keys else (0, (), 0)
        res.short_lookups += short
        t1 = clock()
        if on_disk and settle is not None:
            settle.promotions()
        tg = clock()
        if n:
            rows = get_rows.take(n)
            sizes = client.get_many_into(NAMESPACE, keys[:n], list(rows))
            got = sizes.index(None) if None in sizes else n  # a miss: a promotion whose read found no record
            ok = verify(rows, keys[:got])
            res.verify_failures += got - ok  # blocks that came back with other bytes than stored (never expected)
            n = ok
            res.loaded_bytes += n * block_bytes
            if after_load is not None:
                after_load()
        if hit_writes and settle is not None and n:
            settle.writes(0)
        t2 = clock()
        stored = 0
        if n < len(keys):
            todo = keys[n:]
            rows = put_rows.take(len(todo))
            stamp(rows, todo)
            try:
                put = client.put_many(NAMESPACE, todo, list(rows))
                stored = put.stored
                res.present_on_put += put.already_present
            except StoreFullError:
                res.store_full += 1
            res.stored_blocks += stored
            res.stored_bytes += stored * block_bytes
        t3 = clock()
        if settle is not None and (n or stored):
            settle.writes(stored)
        res.lookup_s += t1 - t0
        res.get_s += t2 - tg
        res.put_s += t3 - t2
        if feed is not None:
            _send(client, feed.after(r), res)
        res.hits.append(n)
        res.disk_hits.append(tuple(i for i in on_disk if i < n))
        if on_request is not None:
            on_request()
    res.wall_s = clock() - start
    return res


def _send(client: Client, sends: Sequence[Send], res: ReplayResult) -> None:
    """Each hint as one Client.hint call; the daemon's outcomes counted by action and outcome."""
    t0 = time.perf_counter()
    counts = res.hint_outcomes
    for s in sends:
        for o in client.hint(NAMESPACE, list(s.keys), s.action, s.ttl_s):
            name = f"hint_{s.action}_{o.value}"
            counts[name] = counts.get(name, 0) + 1
    res.hint_s += time.perf_counter() - t0


def memcpy_gbps(block_bytes: int, blocks: int = 128, rounds: int = 20) -> float:
    """Median single-thread memcpy of a request-sized batch of blocks (warm), measured in the same run as the
    replay so that the store's GB/s can be quoted as a ratio of this machine's ceiling (DESIGN: noisy box)."""
    src = np.ones((blocks, block_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return src.nbytes / statistics.median(times) / 1e9
