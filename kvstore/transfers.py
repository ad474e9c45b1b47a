"""Bytes, latency and throughput of data-plane transfers, kept as plain integers and read at scrape time.

A transfer is one operation that moves bytes on one data plane into or out of one tier:

    plane   tier  direction  one operation is
    arena   ram   in         a Reserve -> Commit window (the client copies into the shared-memory arena)
    arena   ram   out        a leasing Lookup -> its Release (the client copies out of the arena)
    stream  ram   in / out   one Put / Get gRPC stream (bytes inside the RPC, for clients that cannot map)
    disk    disk  in / out   one O_DIRECT write batch (pwrite + fdatasync) / one block read (pread)
    tcp|ucx|grpc  peer  in / out   one batched fetch or push between peers (in: into this node's arena)

Each (plane, tier, direction) keeps a byte counter and two fixed-bucket histograms per operation: seconds and
GB/s (10^9 bytes per second). Operations that moved no bytes are not observed (their throughput means
nothing). The meter lives at the bottom of the layering (no prometheus import) so that the disk tier can
feed it; kvstore.server.metrics turns `snapshot()` into Prometheus families. One lock; an observation is a
couple of bisects and additions (~1 us), once per operation, not per byte.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

__all__ = ["TransferMeter", "TransferSeries", "SECONDS_BUCKETS", "GBPS_BUCKETS", "KNOWN"]

# Arena windows include the client's RPCs and copy (and for gets the asynchronous release), so they reach
# seconds when a lease is held long; disk batches and streams of many MiB take tens of milliseconds.
SECONDS_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                      0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From a slow disk (well under 1 GB/s) to GPU DMA into pinned shared memory (tens of GB/s).
GBPS_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0,
                                   24.0, 32.0, 64.0)

KNOWN: tuple[tuple[str, str, str], ...] = (
    ("arena", "ram", "in"), ("arena", "ram", "out"),
    ("stream", "ram", "in"), ("stream", "ram", "out"),
    ("disk", "disk", "in"), ("disk", "disk", "out"),
    # the peer tier: bytes fetched from / served or pushed to other nodes, per data plane
    ("tcp", "peer", "in"), ("tcp", "peer", "out"),
    ("ucx", "peer", "in"), ("ucx", "peer", "out"),
    ("grpc", "peer", "in"), ("grpc", "peer", "out"),
)


@dataclass(frozen=True)
class TransferSeries:
    """A snapshot of one (plane, tier, direction). Bucket counts are cumulative, the last one is +Inf."""

    plane: str
    tier: str
    direction: str
    bytes: int
    count: int
    seconds_sum: float
    seconds_buckets: tuple[int, ...]
    gbps_sum: float
    gbps_buckets: tuple[int, ...]


class _Series:
    __slots__ = ("bytes", "count", "seconds_sum", "seconds", "gbps_sum", "gbps")

    def __init__(self) -> None:
        self.bytes = self.count = 0
        self.seconds_sum = self.gbps_sum = 0.0
        self.seconds = [0] * (len(SECONDS_BUCKETS) + 1)
        self.gbps = [0] * (len(GBPS_BUCKETS) + 1)


def _cumulative(counts: list[int]) -> tuple[int, ...]:
    out, total = [], 0
    for c in counts:
        total += c
        out.append(total)
    return tuple(out)


class TransferMeter:
    """Thread-safe. The KNOWN series exist from the start (zeros), so dashboards find them before traffic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str, str], _Series] = {key: _Series() for key in KNOWN}

    def add_bytes(self, plane: str, tier: str, direction: str, nbytes: int) -> None:
        """Count bytes whose operation is observed later (or never: an arena lease that expires)."""
        with self._lock:
            self._get(plane, tier, direction).bytes += nbytes

    def observe(self, plane: str, tier: str, direction: str, nbytes: int, seconds: float, *,
                count_bytes: bool = True) -> None:
        """One finished operation of `nbytes` in `seconds`; ignored when it moved nothing."""
        if nbytes <= 0:
            return
        seconds = max(seconds, 1e-9)
        gbps = nbytes / seconds / 1e9
        with self._lock:
            s = self._get(plane, tier, direction)
            if count_bytes:
                s.bytes += nbytes
            s.count += 1
            s.seconds_sum += seconds
            s.seconds[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
            s.gbps_sum += gbps
            s.gbps[bisect.bisect_left(GBPS_BUCKETS, gbps)] += 1

    def _get(self, plane: str, tier: str, direction: str) -> _Series:
        key = (plane, tier, direction)
        s = self._series.get(key)
        if s is None:
            if key not in KNOWN:  # bounded label values: a new plane is added to KNOWN, never invented here
                raise ValueError(f"unknown transfer series {key}: add it to kvstore.transfers.KNOWN")
            s = self._series[key] = _Series()
        return s

    def snapshot(self) -> list[TransferSeries]:
        with self._lock:
            return [TransferSeries(p, t, d, s.bytes, s.count, s.seconds_sum, _cumulative(s.seconds), s.gbps_sum,
                                   _cumulative(s.gbps)) for (p, t, d), s in self._series.items()]
