"""Which parts of an arena mapping are registered as pinned memory for the GPU, kept true as slabs move.

A shared arena (no tokens) is fully resident: it is registered once, whole. A tenant's arena file is sparse
(kvstore/arena/backing.py): registering all of it would pin -- and so allocate -- every slab the tenant does
not own. So only slabs this process copies through are registered, one registration per slab, and a slab's
registration is tied to the slab's binding epoch in the file (kvstore/arena/layout.py). When the daemon moves
an empty slab to another tenant it punches it out of our file and bumps the epoch; our registration then
points at pages the file no longer has (pinned orphans), so a DMA through it would land nowhere. `ensure`
is called with the arena addresses a copy is about to touch, while the caller holds slots there (a
reservation or a lease), so those slabs cannot move until the copy is done; any slab whose epoch changed is
unregistered and registered again. Registrations of slabs that left us are dropped on the next `ensure` too,
which gives their orphaned pages back.

No CUDA here: `register(address, bytes)` and `unregister(address)` are injected (cudaHostRegister and
cudaHostUnregister in kvstore_connector/cuda_copy.py), so tests drive the same logic on CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from kvstore.client.arena_map import ArenaMap

__all__ = ["PinnedRanges"]


class PinnedRanges:
    def __init__(self, m: ArenaMap, register: Callable[[int, int], None],
                 unregister: Callable[[int], None]) -> None:
        self._m = m
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._whole = False
        self._slabs: dict[int, int] = {}  # slab -> epoch it was registered under
        self.registrations = 0            # register calls made (for tests and logs)

    def slabs_of(self, addresses: np.ndarray) -> list[int]:
        """Slabs of the arena's data region that `addresses` (absolute) fall in; others are ignored."""
        m, lay = self._m, self._m.layout
        a = np.asarray(addresses, dtype=np.uint64)
        lo, hi = m.address + lay.data_offset, m.address + lay.size_bytes
        inside = a[(a >= np.uint64(lo)) & (a < np.uint64(hi))]
        return sorted(set(((inside - np.uint64(lo)) // np.uint64(lay.slab_bytes)).tolist()))

    def ensure(self, addresses: np.ndarray) -> None:
        """Make every arena slab under `addresses` registered under its current epoch."""
        m = self._m
        with self._lock:
            if not m.isolated:
                if not self._whole:
                    self._register(m.address, m.size)
                    self._whole = True
                    self.registrations += 1
                return
            wanted = self.slabs_of(addresses)
            for slab, epoch in list(self._slabs.items()):
                if slab not in wanted and m.epoch(slab) != epoch:  # left this file: drop its orphaned pins
                    self._unregister(self._slab_address(slab))
                    del self._slabs[slab]
            for slab in wanted:
                epoch = m.epoch(slab)
                have = self._slabs.get(slab)
                if have == epoch:
                    continue
                if have is not None:
                    self._unregister(self._slab_address(slab))
                self._register(self._slab_address(slab), m.layout.slab_bytes)
                self._slabs[slab] = epoch
                self.registrations += 1

    def registered(self) -> dict[int, int]:
        with self._lock:
            return dict(self._slabs)

    def close(self) -> None:
        with self._lock:
            if self._whole:
                self._unregister(self._m.address)
                self._whole = False
            for slab in self._slabs:
                self._unregister(self._slab_address(slab))
            self._slabs.clear()

    def _slab_address(self, slab: int) -> int:
        return self._m.address + self._m.layout.slab_data_range(slab)[0]
