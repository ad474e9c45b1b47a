"""Where a slot's generation word lives, computed from constants read once.

The same arithmetic as `ArenaLayout.generation_index(es)`, but the layout's constants are properties that
recompute on each read (~1 us apiece), and the engine asks on every Lookup (all hits at once) and on every
free. The layout is immutable, so reading them once is exact.
"""

from __future__ import annotations

import numpy as np

from kvstore.arena.layout import ArenaLayout

__all__ = ["GenerationIndex"]


class GenerationIndex:
    def __init__(self, layout: ArenaLayout) -> None:
        self._base = layout.data_offset
        self._slab = layout.slab_bytes
        self._stride = layout.gen_stride
        self._page = layout.page_bytes
        self._pages_per_slab = layout.slab_bytes // layout.page_bytes  # exact: the layout checks the multiple

    def of(self, offset: int) -> int:
        """Index, in uint64 words of the generation table, of the slot that starts at `offset`."""
        slab, within = divmod(offset - self._base, self._slab)
        return slab * self._stride + 1 + within // self._page

    def of_many(self, offsets: np.ndarray) -> np.ndarray:
        """`of` for an int64 array of offsets."""
        # slab * stride + 1 + within // page, in pages: p = (offset - base) // page, slab = p // pages_per_slab
        pages = offsets - self._base
        pages //= self._page
        slabs = pages // self._pages_per_slab
        slabs *= self._stride - self._pages_per_slab
        pages += slabs
        pages += 1
        return pages
