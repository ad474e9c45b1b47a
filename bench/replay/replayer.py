"""Replay a trace through the REAL daemon with the REAL client, the way a vLLM connector drives the store.

Per request, in arrival order (as fast as the store answers; arrival times shape only the capacity model):
  1. lookup_prefix(keys): the scheduler side asks how many leading blocks are stored (no lease);
  2. get_many_into(hit keys, preallocated rows): the worker side loads them (lease -> copy -> release) and the
     replay checks each block's key marks, trusting the chain only up to the first bad block;
  3. put_many(the missed keys, stamped rows): the worker side saves the blocks it computed.
The hit of a request is the number of verified loaded blocks: the store's measured hit, to compare with the
simulator's request by request.

Why leases can matter: the client releases leases asynchronously, so a put may run while the blocks it just
loaded are still leased and unevictable, which the simulator does not model. Those blocks are the most recent
ones, so this can change a victim only when a request's blocks fill most of the RAM tier. There, and only
there (capacity under 4 of the largest request), the replay waits between a load and its put until the daemon
holds no lease, which makes store and simulator agree exactly at any capacity. This is also the realistic
order: in vLLM the prefill compute sits between the load and the put, so the releases have long landed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.replay.keys import chain_keys, stamp, verify
from bench.replay.tiers import StoreSpec
from bench.replay.trace import Convention, Request
from kvstore.client import Client
from kvstore.errors import StoreFullError
from kvstore.testing import DaemonProcess, wait_until

__all__ = ["ReplayResult", "replay", "wait_for_leases", "memcpy_gbps"]

NAMESPACE = "replay"
SYNC_BELOW_REQUESTS = 4


@dataclass
class ReplayResult:
    hits: list[int]
    loaded_bytes: int = 0
    stored_bytes: int = 0
    stored_blocks: int = 0
    present_on_put: int = 0
    store_full: int = 0
    verify_failures: int = 0
    lookup_s: float = 0.0
    get_s: float = 0.0
    put_s: float = 0.0
    wall_s: float = 0.0
    resident_blocks: int = 0
    synced_leases: bool = False
    counters: dict[str, int] = field(default_factory=dict)


class _Rows:
    """A reusable (n, block_bytes) uint8 array: the preallocated KV buffers of a worker, grown on demand."""

    def __init__(self, block_bytes: int, rows: int = 64) -> None:
        self._a = np.zeros((rows, block_bytes), dtype=np.uint8)

    def take(self, n: int) -> np.ndarray:
        if n > len(self._a):
            self._a = np.zeros((max(n, 2 * len(self._a)), self._a.shape[1]), dtype=np.uint8)
        return self._a[:n]


def replay(requests: Sequence[Request], spec: StoreSpec, *, convention: Convention = Convention.FULL_BLOCKS,
           on_request: Callable[[], None] | None = None, sync_leases: bool | None = None) -> ReplayResult:
    """Start a daemon sized by `spec`, replay `requests` through it, stop it; the measured result.

    sync_leases: wait between each load and its put until the daemon holds no lease. None = only where it can
    change a victim, i.e. when the RAM tier holds fewer than `SYNC_BELOW_REQUESTS` of the largest request.
    """
    if sync_leases is None:
        largest = max((len(r.cacheable_ids(convention)) for r in requests), default=0)
        sync_leases = spec.tiers[0].capacity_blocks < SYNC_BELOW_REQUESTS * largest
    with DaemonProcess(**spec.daemon_options()) as daemon, daemon.client() as client:
        client.register_namespace(NAMESPACE, model="trace-replay", layout_digest=f"bpt{spec.bytes_per_token}")
        sync = (lambda: wait_for_leases(client)) if sync_leases else None
        result = _run(client, requests, spec.block_bytes, convention, on_request, sync)
        stats = client.stats()
        result.resident_blocks = stats.blocks
        result.counters = dict(stats.counters)
        result.synced_leases = sync_leases
    return result


def wait_for_leases(client: Client, timeout_s: float = 10.0) -> None:
    """Block until the client's background releases have reached the daemon (an explicit sync point)."""
    wait_until(lambda: client.stats().leases_active == 0, timeout_s=timeout_s, interval_s=0.001,
               what="the replay's leases to be released")


def _run(client: Client, requests: Sequence[Request], block_bytes: int, convention: Convention,
         on_request: Callable[[], None] | None = None, after_load: Callable[[], None] | None = None) -> ReplayResult:
    """The loop; `after_load` is a sync point between a request's load and its put (tests wait there for the
    background lease releases, which makes the run exact at any capacity)."""
    res = ReplayResult(hits=[])
    get_rows, put_rows = _Rows(block_bytes), _Rows(block_bytes)
    clock = time.perf_counter
    start = clock()
    for r in requests:
        keys = chain_keys(r.cacheable_ids(convention))
        t0 = clock()
        n = client.lookup_prefix(NAMESPACE, keys) if keys else 0
        t1 = clock()
        if n:
            rows = get_rows.take(n)
            sizes = client.get_many_into(NAMESPACE, keys[:n], list(rows))
            got = sizes.index(None) if None in sizes else n
            ok = verify(rows, keys[:got])
            res.verify_failures += n - ok
            n = ok
            res.loaded_bytes += n * block_bytes
            if after_load is not None:
                after_load()
        t2 = clock()
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
                stored = 0
            res.stored_blocks += stored
            res.stored_bytes += stored * block_bytes
        t3 = clock()
        res.lookup_s += t1 - t0
        res.get_s += t2 - t1
        res.put_s += t3 - t2
        res.hits.append(n)
        if on_request is not None:
            on_request()
    res.wall_s = clock() - start
    return res


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
