"""Where things are inside an arena file; the same for the daemon's view and every tenant's file.

Layout of one arena file (and of the daemon's stitched view of all of them)::

    [ generation table: one block per slab               ][ pad to 2 MiB ][ data: slab 0 | slab 1 | ... ]
      block of slab s = [ epoch ][ gen of page 0 ][ gen of page 1 ] ... rounded up to whole pages

Why per-slab blocks rather than one flat table: a slab is the unit that moves between tenants' files (see
backing.py). Its generations must move with it, so they sit on pages of their own, which the daemon can map
from whichever file backs the slab now. The extra `epoch` word counts how often the slab was bound to (or
taken from) this file: a process that pinned the slab's pages (cudaHostRegister) compares it, while it holds a
slot in the slab, with the value it registered under; any difference means its registration points at
pages the file no longer has.

A generation is bumped every time a slot's block is freed; a reader compares it after its copy, without an
RPC, to tell a copy of the leased block from a copy of a slot that was reclaimed under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvstore._native import first_outside
from kvstore.errors import ConfigError

__all__ = ["ArenaLayout", "PAGE_BYTES", "DATA_ALIGN"]

PAGE_BYTES = 4096
DATA_ALIGN = 2 * 1024 * 1024


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ArenaLayout:
    """Geometry of an arena; sent to clients (Health.arena) so they can read the files they are handed."""

    name: str
    n_slabs: int
    slab_bytes: int
    page_bytes: int = PAGE_BYTES

    def __post_init__(self) -> None:
        if self.n_slabs < 1:
            raise ConfigError(f"arena {self.name!r} needs at least one slab, not {self.n_slabs}")
        if self.slab_bytes <= 0 or self.slab_bytes % self.page_bytes:
            raise ConfigError(f"slab size {self.slab_bytes} must be a positive multiple of {self.page_bytes}")

    @staticmethod
    def for_capacity(name: str, data_bytes: int, slab_bytes: int) -> ArenaLayout:
        """The largest arena of whole slabs that fits in `data_bytes`."""
        if slab_bytes <= 0 or slab_bytes % PAGE_BYTES:
            raise ConfigError(f"slab size {slab_bytes} must be a positive multiple of {PAGE_BYTES}")
        return ArenaLayout(name, data_bytes // slab_bytes, slab_bytes)

    # -- geometry (each computed once: a client's every put and get reads several; fields never change) ----
    @cached_property
    def pages_per_slab(self) -> int:
        return self.slab_bytes // self.page_bytes

    @cached_property
    def gen_stride(self) -> int:
        """uint64 words per slab in the generation table (epoch + one per page, padded to whole pages)."""
        return _round_up((1 + self.pages_per_slab) * 8, self.page_bytes) // 8

    @property
    def gen_table_offset(self) -> int:
        return 0

    @cached_property
    def gen_table_bytes(self) -> int:
        return self.n_slabs * self.gen_stride * 8

    @cached_property
    def data_offset(self) -> int:
        return _round_up(self.gen_table_bytes, DATA_ALIGN)

    @cached_property
    def data_bytes(self) -> int:
        return self.n_slabs * self.slab_bytes

    @cached_property
    def size_bytes(self) -> int:
        return self.data_offset + self.data_bytes

    # -- addressing -------------------------------------------------------------------------------------
    def slab_of(self, offset: int) -> int:
        """The slab holding the slot at `offset` (from the mapping's start)."""
        return (offset - self.data_offset) // self.slab_bytes

    def slab_data_range(self, slab: int) -> tuple[int, int]:
        """(offset, bytes) of a slab's data in the file."""
        return self.data_offset + slab * self.slab_bytes, self.slab_bytes

    def slab_gen_range(self, slab: int) -> tuple[int, int]:
        """(offset, bytes) of a slab's generation block (epoch word first) in the file."""
        return self.gen_table_offset + slab * self.gen_stride * 8, self.gen_stride * 8

    def epoch_index(self, slab: int) -> int:
        """Index, in uint64 words of the generation table, of a slab's epoch."""
        return slab * self.gen_stride

    def generation_index(self, offset: int) -> int:
        """Index, in uint64 words of the generation table, of the slot that starts at `offset`."""
        slab, within = divmod(offset - self.data_offset, self.slab_bytes)
        return slab * self.gen_stride + 1 + within // self.page_bytes

    def generation_indices(self, offsets: np.ndarray) -> np.ndarray:
        """Vectorized generation_index (int64 offsets in, int64 indices out)."""
        rel = np.asarray(offsets, dtype=np.int64) - self.data_offset
        slab, within = np.divmod(rel, self.slab_bytes)
        return slab * self.gen_stride + 1 + within // self.page_bytes

    def contains_slot(self, offset: int, size: int) -> bool:
        """True when [offset, offset + size) lies inside one slab of the data region."""
        if offset < self.data_offset or size < 0 or offset + size > self.size_bytes:
            return False
        return size == 0 or self.slab_of(offset) == self.slab_of(offset + size - 1)

    def first_outside(self, offsets: np.ndarray, sizes: np.ndarray) -> int:
        """`contains_slot` of a batch (uint64 arrays), in C: the index of the first range that is not in one
        slab of the data region, -1 when all are (a client checks every slot a daemon names before copying: a
        Python call each cost ~2.6 us, numpy ~130 us a 32-block put with cold caches)."""
        return first_outside(offsets, sizes, self.data_offset, self.size_bytes, self.slab_bytes)
