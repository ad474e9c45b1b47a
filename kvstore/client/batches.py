"""Batch helpers of the high-level calls: split a batch at the daemon's max_batch_keys, spread hits over keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["chunks", "scatter"]


def chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(n, start + size))


def scatter(present: list[bool], hits: list[Any], n: int) -> list[Any]:
    """Spread per-hit results over the requested keys (None for misses and keys past a prefix stop)."""
    out: list[Any] = [None] * n
    it = iter(hits)
    for i, p in enumerate(present):
        if p:
            out[i] = next(it)
    return out
