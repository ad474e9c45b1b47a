"""The copy limit a benchmark divides the product by: the best this machine does moving the same bytes.

Why not `np.copyto`: the product copies with `kvstore._native.copy_addrs` on N threads (the client's
`copy_threads`, 2 by default; the connector's `copy_threads`). Dividing a 2-thread product by a 1-thread
numpy copy credits the product with a second core the limit never got (on a quiet box the ratio can pass 1)
or, on a busy 2-core box where the second thread only adds contention, blames it for a choice of thread count.
The honest limit is the native copy itself, of the same buffers and sizes, at every thread count the product
may use (1 and 2), timed round-robin with the product in the same run; the faster median is the limit, and
the report names its thread count. A product ratio above 1 then means the limit was measured wrong.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench._common import Case, Samples, gbs
from kvstore._native import copy_addrs, evict_lines

__all__ = ["LIMIT_THREADS", "Addrs", "Limit", "addrs", "native_cases", "best_limit", "last_level_cache_bytes",
           "ColdSources", "cold"]

LIMIT_THREADS = (1, 2)

# (dst addresses, src addresses, lengths), uint64 each: what copy_addrs takes
Addrs = tuple[np.ndarray, np.ndarray, np.ndarray]


def addrs(dsts: Sequence[np.ndarray], srcs: Sequence[np.ndarray]) -> Addrs:
    """copy_addrs' triples for copying srcs[i] into dsts[i] (C-contiguous arrays of equal byte sizes)."""
    for d, s in zip(dsts, srcs, strict=True):
        if d.nbytes != s.nbytes or not (d.flags.c_contiguous and s.flags.c_contiguous):
            raise ValueError(f"limit copy: {d.nbytes} <- {s.nbytes} bytes, both must be equal and contiguous")
    return (np.asarray([d.ctypes.data for d in dsts], np.uint64), np.asarray([s.ctypes.data for s in srcs], np.uint64),
            np.asarray([s.nbytes for s in srcs], np.uint64))


def native_cases(make: Callable[[], Addrs], prefix: str = "native",
                 threads: Sequence[int] = LIMIT_THREADS) -> dict[str, Case]:
    """One case per thread count: `copy_addrs(*make(), threads=t)`, `make` running untimed before each
    iteration (it may rotate destinations, so every case sees cold pages alike). Names: f"{prefix}{t}"."""
    def case(t: int) -> Case:
        return Case(lambda a: copy_addrs(*a, threads=t), make)
    return {f"{prefix}{t}": case(t) for t in threads}


@dataclass(frozen=True)
class Limit:
    """The faster native copy: its thread count and samples (the limit the product is divided by)."""

    threads: int
    samples: Samples

    def gbs(self, nbytes: int) -> float:
        return gbs(nbytes, self.samples.p50)

    def fields(self, nbytes: int, prefix: str = "limit") -> dict[str, float | int]:
        return {f"{prefix}_threads": self.threads, f"{prefix}_gbs": round(self.gbs(nbytes), 3)}


def best_limit(res: dict[str, Samples], prefix: str = "native", threads: Sequence[int] = LIMIT_THREADS) -> Limit:
    """The native case with the smallest median among `res[f"{prefix}{t}"]`."""
    t = min(threads, key=lambda t: res[f"{prefix}{t}"].p50)
    return Limit(t, res[f"{prefix}{t}"])


def last_level_cache_bytes(default: int = 64 << 20, root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest CPU cache of cpu0 (sysfs: index*/size, as "307200K"), `default` where the kernel does not say."""
    best = 0
    for d in glob.glob(os.path.join(root, "index*")):
        try:
            with open(os.path.join(d, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


class ColdSources:
    """Before each timed call of a batch case (the limit and the store alike), the lines of the bytes it will
    read leave every cache level: each copy reads from memory, as a KV block saved after a forward pass or
    loaded for an agent's next turn does, while the store's own code and tables stay as warm as they are.

    Why: this VM reports a 300 MiB last-level cache, and a 64 MiB batch read again soon after stays there
    (the limit's sources, read back to back: 18-21 GB/s; the same copy from memory: 14.4-14.8, as are the
    store's own copies). Which case found its sources cached changed from run to run with the order and the
    host's other tenants, and arena ratios swung 0.8-1.15. Flushing by copying a buffer larger than the cache
    is what other CPUs get (evict_lines does nothing there): it also cools the store's code and tables
    (an engine Store of 32 keys: 109 us warm, 277 us after it), and its destination is written with
    streaming stores, so no dirty lines slow the next copy with their write-backs."""

    def __init__(self, fallback_bytes: int | None = None) -> None:
        self._fallback_bytes = fallback_bytes
        self._fallback: tuple[np.ndarray, np.ndarray] | None = None
        self.calls = 0

    def __call__(self, addrs: np.ndarray, lengths: np.ndarray) -> None:
        """UNCHECKED like copy_addrs: every range must be mapped."""
        self.calls += 1
        if evict_lines(addrs, lengths) or not lengths.any():
            return
        if self._fallback is None:
            n = self._fallback_bytes or min(1 << 30, max(32 << 20, last_level_cache_bytes()))
            self._fallback = (np.ones(n, np.uint8), np.zeros(n, np.uint8))
        src, dst = self._fallback
        copy_addrs([dst.ctypes.data], [src.ctypes.data], [src.nbytes], threads=max(LIMIT_THREADS), stream=1)


def cold(case: Case, before: Callable[[Any], object]) -> Case:
    """`case` with `before(its setup's value)` run after its setup, both untimed."""
    def setup() -> Any:
        arg = case.setup() if case.setup is not None else None
        before(arg)
        return arg
    return Case(case.fn, setup, case.teardown)
