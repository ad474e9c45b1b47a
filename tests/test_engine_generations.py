"""The engine's GenerationIndex gives the layout's generation_index(es) for every offset (it only reads the
layout's constants once and computes in pages); a wrong word would make readers trust a reused slot."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.arena.layout import ArenaLayout
from kvstore.engine.generations import GenerationIndex


@pytest.mark.parametrize("slab_bytes", [4096, 2 << 20, 4 << 20, 3 * 4096 * 7])
def test_generation_index_matches_the_layout_for_every_offset(slab_bytes: int) -> None:
    lay = ArenaLayout.for_capacity("t", slab_bytes * 13, slab_bytes)
    g = GenerationIndex(lay)
    rng = np.random.default_rng(slab_bytes)
    pages = np.arange(lay.data_offset, lay.data_offset + lay.data_bytes, 4096, dtype=np.int64)
    odd = rng.integers(lay.data_offset, lay.data_offset + lay.data_bytes, 5000, dtype=np.int64)  # any slot start
    for offsets in (pages, odd):
        want = lay.generation_indices(offsets)
        assert g.of_many(offsets.copy()).tolist() == want.tolist()
        assert [g.of(o) for o in offsets[::7].tolist()] == want[::7].tolist()
