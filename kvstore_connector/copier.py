"""Byte movers between the arena and vLLM's KV cache, chosen by where the cache lives.

`CpuCopier`: the native batched copy (kvstore._native.copy_addrs), GIL released, one call per batch.
`kvstore_connector.cuda_copy.CudaCopier`: the arena registered as pinned, device-mapped host memory and one kernel
launch per batch on a dedicated stream (see that module). Both take a `CopyPlan` and never loop over blocks
or layers in Python.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvstore_connector.layout import CopyPlan
from kvstore._native import copy_addrs
from kvstore.client.arena_map import ArenaMap

__all__ = ["Copier", "CpuCopier", "make_copier"]


class Copier(Protocol):
    def copy(self, plan: CopyPlan, after: Any = None) -> Any:
        """Start the copy (after the event `after`, if given); returns a handle for `wait` (None when the copy
        is already done)."""

    def wait(self, handle: Any) -> None:
        """Block until the copy behind ``handle`` is complete."""

    def close(self) -> None: ...


class CpuCopier:
    def __init__(self, threads: int = 2) -> None:
        self.threads = threads

    def copy(self, plan: CopyPlan, after: Any = None) -> None:
        if len(plan.lengths):
            copy_addrs(plan.dst, plan.src, plan.lengths, threads=self.threads)

    def wait(self, handle: Any) -> None:
        return None

    def close(self) -> None:
        return None


def make_copier(device: str, arena: ArenaMap, threads: int) -> Copier:
    """The copier for KV caches on ``device`` ("cpu", "cuda:0", ...) through the mapping ``arena``; it is
    closed by the mapping's close hook, after the last copy that holds a reference to it."""
    if device.startswith("cuda"):
        from kvstore_connector.cuda_copy import CudaCopier  # imports torch.cuda / cupy only on GPU nodes

        copier: Copier = CudaCopier(arena, device)
    else:
        copier = CpuCopier(threads)
    arena.on_close(copier.close)
    return copier
