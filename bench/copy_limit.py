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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from bench._common import Case, Samples, gbs
from kvstore._native import copy_addrs

__all__ = ["LIMIT_THREADS", "Addrs", "Limit", "addrs", "native_cases", "best_limit"]

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
