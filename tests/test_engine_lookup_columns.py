"""LookupResult.columns holds the same hit values as its lists, on the short path (hits = the first keys, all in
RAM) and on the general one (misses in between, no prefix), with and without a lease; results compare equal
whether or not they carry columns (the lists are the answer; the arrays only spare an encoder the packing)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.arena.allocator import SlabAllocator
from kvstore.arena.layout import ArenaLayout
from kvstore.engine.engine import Engine
from kvstore.engine.results import EngineConfig
from kvstore.policies import make_policy

MiB = 1 << 20


def _engine() -> Engine:
    lay = ArenaLayout.for_capacity("x", 16 * MiB, 1 * MiB)
    eng = Engine(EngineConfig(max_block_bytes=1 * MiB), lay, np.zeros(lay.gen_table_bytes // 8, dtype=np.uint64),
                 SlabAllocator(lay.data_offset, lay.data_bytes, 1 * MiB), make_policy("lru"))
    eng.register_namespace("ns")
    return eng


@pytest.mark.parametrize("lease", [False, True])
@pytest.mark.parametrize(("prefix", "want_hits"), [(True, 3), (False, 5)])
def test_columns_equal_the_lists(lease: bool, prefix: bool, want_hits: int) -> None:
    eng = _engine()
    keys = [b"k%d" % i for i in range(6)]
    r = eng.reserve("ns", keys, [1000 + i for i in range(6)])
    eng.commit(r.reservation_id, [7, 0, 2**64 - 1, 9, 10, 11])
    eng.delete("ns", [b"k3"])
    eng.delete("ns", [b"k0"])  # its slot freed: the generation word of that slot is bumped
    r2 = eng.reserve("ns", [b"k0"], [1000])  # k0 again, in a slot whose generation is 1
    eng.commit(r2.reservation_id, [7])
    got = eng.lookup("ns", keys, prefix=prefix, lease=lease)
    assert got.num_prefix == 3 and len(got.offsets) == want_hits
    assert got.sizes == ([1000, 1001, 1002] + ([1004, 1005] if not prefix else []))
    assert got.checksums == ([7, 0, 2**64 - 1] + ([10, 11] if not prefix else []))
    assert got.generations[0] == 1 and got.generations[1:] == [0] * (want_hits - 1)
    cols = got.columns
    assert cols is not None
    for name in ("offsets", "sizes", "generations", "checksums"):
        assert getattr(cols, name).tolist() == getattr(got, name), name
    assert cols.generations.dtype == np.uint64 and cols.checksums.dtype == np.uint64
    bare = type(got)(got.num_prefix, got.present, got.offsets, got.sizes, got.generations, got.checksums,
                     got.lease_id, got.expires_in_ms, got.tiers)
    assert bare == got and bare.columns is None
    assert eng.lookup("ns", [b"nope"], prefix=prefix, lease=lease).columns is None  # no hits: use the lists
