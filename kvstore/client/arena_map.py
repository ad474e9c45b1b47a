"""A client's mapping of its arena file, kept alive for as long as any copy uses it.

Why reference counting: the vLLM connector copies through raw addresses on its loader and committer threads
(and, on CUDA, from kernels still running on a stream) while another thread may learn that the daemon
restarted and map the new arena, or close the client because the store went down. Unmapping under such a
copy is a segfault, or a DMA into memory that now belongs to something else. So a mapping is never unmapped
by the thread that replaces it: `retire()` only marks it, and the memory goes away when the last `acquire()`
is matched by its `release()`. Callbacks registered with `on_close` (a CUDA copier: synchronize its stream,
then unregister the pinned range) run first, in the thread that dropped the last reference.

All of a copy's work -- the copy itself, waiting for it, the generation check -- must happen between one
acquire and its release; a mapping that is already retired refuses new acquires (`acquire()` is False).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType

import numpy as np

from kvstore.arena import vm
from kvstore.arena.layout import ArenaLayout

__all__ = ["ArenaMap"]

log = logging.getLogger(__name__)


class ArenaMap:
    def __init__(self, fd: int, layout: ArenaLayout, incarnation: int, *, isolated: bool) -> None:
        """Maps `fd` (the descriptor is closed here: the mapping keeps the file). A shared arena is fully
        resident, so its page tables are filled now (MAP_POPULATE); an isolated tenant's file is sparse and
        populating it would allocate its unused slabs, so its pages are mapped as they are first touched."""
        self.layout = layout
        self.incarnation = incarnation
        self.isolated = isolated
        flags = vm.MAP_SHARED | (0 if isolated else vm.MAP_POPULATE)
        try:
            self.address = vm.mmap(0, layout.size_bytes, flags, fd, 0)
        finally:
            os.close(fd)
        self.size = layout.size_bytes
        self.generations = vm.u64_view(self.address + layout.gen_table_offset, layout.gen_table_bytes // 8)
        self._lock = threading.Lock()
        self._refs = 0
        self._retired = False
        self._closed = False
        self._closers: list[Callable[[], None]] = []

    # -- lifetime ---------------------------------------------------------------------------------------
    def acquire(self) -> bool:
        """Take a reference for one copy; False when the mapping is retired (use the client's current one)."""
        with self._lock:
            if self._retired:
                return False
            self._refs += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._retired and self._refs == 0
        if last:
            self._close()

    def retire(self) -> None:
        """No new copies; unmap when the running ones are done (now, if none runs)."""
        with self._lock:
            if self._retired:
                return
            self._retired = True
            last = self._refs == 0
        if last:
            self._close()

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run `fn` before the memory is unmapped (or now, if it already was)."""
        with self._lock:
            if not self._closed:
                self._closers.append(fn)
                return
        fn()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def references(self) -> int:
        return self._refs

    def _close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            closers, self._closers = self._closers, []
        for fn in closers:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a failing closer must not keep the memory mapped forever
                log.exception("arena mapping close hook failed")
        self.generations = None  # type: ignore[assignment]  # unmapped: a later use fails loudly
        vm.munmap(self.address, self.size)

    def __enter__(self) -> ArenaMap:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    # -- reads of the header ----------------------------------------------------------------------------
    def generations_at(self, offsets: np.ndarray) -> np.ndarray:
        """Current generations of the slots at `offsets` (call while acquired)."""
        return self.generations[self.layout.generation_indices(offsets)].copy()

    def epoch(self, slab: int) -> int:
        """The slab's binding epoch in this file (layout.py); stable while this process holds a slot in it."""
        return int(self.generations[self.layout.epoch_index(slab)])
