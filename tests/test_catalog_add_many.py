"""Catalog.add_many hands out the same ids and writes the same columns and index as `add` of each item in order
(reserve uses it; the ids decide the policy's order of inserts, which the exact replay in test_replay.py checks)."""

from __future__ import annotations

import random

import numpy as np

from kvstore.engine.catalog import _COLUMNS, Catalog


def _state(cat: Catalog, n_ns: int) -> object:
    cols = {name: getattr(cat, name)[: len(cat.keys)].tolist() for name, _ in _COLUMNS if name != "created"}
    return cols, list(cat.keys), list(cat._free_ids), [dict(cat.namespaces[i].index) for i in range(n_ns)]


def test_add_many_equals_add_of_each_through_reuse_and_growth() -> None:
    rng = random.Random(7)
    one, many = Catalog(initial_capacity=16), Catalog(initial_capacity=16)
    for cat in (one, many):
        cat.add_namespace("a", "", "", "")
        cat.add_namespace("b", "", "", "")
    live: list[int] = []
    for step in range(300):
        ns_id = rng.randrange(2)
        batch = [rng.randbytes(8) for _ in range(rng.randint(1, 40))]
        offsets = [rng.randrange(1 << 30) for _ in batch]
        sizes = [rng.randint(1, 1 << 20) for _ in batch]
        got = [one.add(one.namespaces[ns_id], k, o, s) for k, o, s in zip(batch, offsets, sizes)]
        assert many.add_many(many.namespaces[ns_id], batch, offsets, sizes) == got
        live += got
        for eid in rng.sample(live, rng.randint(0, len(live) // 3)):  # frees in any order: the free list's order
            for cat in (one, many):
                cat.unindex(eid)
                cat.drop(eid)
            live.remove(eid)
        assert _state(many, 2) == _state(one, 2), f"step {step}"
    assert len(one.keys) > 128 and one._capacity == many._capacity >= 256  # grew several times
    assert np.all(many.created[live] > 0)


def test_mark_committed_sets_state_time_checksums_and_sums_sizes_for_small_and_large_batches() -> None:
    cat = Catalog()
    ns = cat.add_namespace("a", "", "", "")
    for n in (1, 7, 8, 40):
        keys = [b"%d-%d" % (n, i) for i in range(n)]
        eids = cat.add_many(ns, keys, [4096 * i for i in range(n)], [100 + i for i in range(n)])
        before = cat.now()
        sums = [2**64 - 1 - i for i in range(n)]
        assert cat.mark_committed(eids, sums) == sum(100 + i for i in range(n))
        assert cat.state[eids].tolist() == [2] * n  # EntryState.COMMITTED
        assert cat.checksum[eids].tolist() == sums
        assert np.all(cat.created[eids] >= np.float32(before))
        other = cat.add_many(ns, [k + b"x" for k in keys], [0] * n, [5] * n)
        assert cat.mark_committed(other) == 5 * n and cat.checksum[other].tolist() == [0] * n
