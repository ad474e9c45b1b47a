"""`on_access_many` and `on_access_batches` of each policy end in exactly the state of `on_access` of each id.

The engine replays its deferred read buffer through `on_access_many`, and the exact store-vs-simulator replay
(test_replay.py) depends on the eviction order being the one the per-hit calls give. The batch form takes
shortcuts (LRU: cutting runs that already lie in the list in order, skipping a batch that a later one
repeats; S3-FIFO: adding the hits of an id at once), so these scripts drive three instances of a policy with
the same operations, one hit at a time, batch by batch and all of a step's batches in one call, and compare
the whole order after every step and the victims at the end.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.factory import POLICY_NAMES, make_policy
from kvstore.policies.lru import LRUPolicy


def _lru_order(p: LRUPolicy) -> list[int]:
    """Most recent first, by walking the links both ways (a broken back link shows up as a mismatch)."""
    forward, eid = [], p._head
    while eid != -1:
        forward.append(eid)
        eid = p._next[eid]
    backward, eid = [], p._tail
    while eid != -1:
        backward.append(eid)
        eid = p._prev[eid]
    assert backward[::-1] == forward
    return forward


def _state(p: EvictionPolicy) -> object:
    if isinstance(p, LRUPolicy):
        return _lru_order(p), len(p)
    return p._freq.tolist(), p._queue.tolist(), p._prev.tolist(), p._next.tolist(), len(p)  # type: ignore[attr-defined]  # S3-FIFO's private arrays: the test compares internal state


def _drain(p: EvictionPolicy, eligible) -> list[int]:
    out = []
    while (v := p.choose_victim(eligible)) is not None:
        out.append(v)
    return out


def _batches(rng: random.Random, tracked: list[int], chain: list[int]) -> list[list[int]]:
    """Shapes the engine produces (a chain read in order, a prefix of it, again) and ones it may (scattered,
    repeated ids, untracked, negative or out-of-range ids, tiny batches)."""
    scattered = rng.sample(tracked, min(len(tracked), rng.randint(1, 60)))
    repeated = [rng.choice(tracked) for _ in range(rng.randint(1, 80))]
    odd = scattered[:10] + [-3, 10**6, 5000] + repeated[:10]
    return [chain, chain[: rng.randint(1, len(chain))], chain, chain, scattered, repeated, odd, chain[::-1],
            chain + scattered, chain, [rng.choice(tracked)], [], scattered, scattered[: len(scattered) // 2], chain]


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_access_many_ends_where_each_access_in_order_ends(name: str, seed: int) -> None:
    rng = random.Random(seed)
    one, many, bulk = (make_policy(name, initial_capacity=64) for _ in range(3))
    both = (one, many, bulk)
    next_eid = 0
    tracked: list[int] = []
    for step in range(60):
        # a commit of a chain (ids in order), sometimes deletes, then the batches of hits
        chain = list(range(next_eid, next_eid + rng.randint(1, 300)))
        next_eid += len(chain)
        for eid in chain:
            fp = rng.getrandbits(64) or 1
            for p in both:
                p.on_insert(eid, fp)
        tracked += chain
        for eid in rng.sample(tracked, min(len(tracked), rng.randint(0, 20))):
            for p in both:
                p.on_remove(eid)
            tracked.remove(eid)
        batches = _batches(rng, tracked or [0], chain)
        for batch in batches:
            for eid in batch:
                one.on_access(eid)
            many.on_access_many(np.array(batch, dtype=np.int64) if step % 2 else batch)
            assert _state(many) == _state(one), f"step {step}, batch {batch[:8]}..."
        bulk.on_access_batches([np.array(b, dtype=np.int64) for b in batches])
        assert _state(bulk) == _state(one), f"step {step}"
        # evictions in between, with some entries not eligible (leased)
        held = set(rng.sample(tracked, min(len(tracked), 30)))
        for _ in range(rng.randint(0, 40)):
            victims = {p.choose_victim(lambda e: e not in held) for p in both}
            assert len(victims) == 1
            if (victim := victims.pop()) is not None:
                tracked.remove(victim)
        assert _state(many) == _state(one) == _state(bulk)
    some = [_drain(p, lambda e: e % 3 != 0) for p in both]
    assert some[0] and some[1] == some[0] and some[2] == some[0]
    rest = [_drain(p, lambda e: True) for p in both]
    assert rest[0] and rest[1] == rest[0] and rest[2] == rest[0]
    assert len(many) == len(one) == len(bulk) == 0


def test_lru_access_many_of_a_chain_moves_it_to_the_head_in_read_order() -> None:
    # insert 0..9 -> order (most recent first) 9..0; read [2, 3, 4] -> 4 3 2 9 8 7 6 5 1 0
    p = LRUPolicy()
    for eid in range(10):
        p.on_insert(eid)
    p.on_access_many(list(range(2, 5)) * 6)  # 18 ids: the batch path; repeats: the last read counts
    assert _lru_order(p) == [4, 3, 2, 9, 8, 7, 6, 5, 1, 0]
    p.on_access_many([0, 1, 9, 8, 7, 6, 5, 4, 3, 2, 0, 1, 2, 3, 4, 5, 6, 7])  # scattered -> per-id path
    assert _lru_order(p) == [7, 6, 5, 4, 3, 2, 1, 0, 8, 9]
    assert p.choose_victim(lambda e: e != 9) == 8  # 9 is the least recent but held


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_insert_many_ends_where_each_insert_in_order_ends(name: str, seed: int) -> None:
    """on_insert_many(ids, fingerprints) is on_insert of each in order, for every policy (LRU links them in one
    loop, the others take the base loop): same state, same victims; through the hint wrapper too."""
    from kvstore.policies.hinted import with_hints
    rng = random.Random(seed)
    one, many = make_policy(name), with_hints(make_policy(name))
    next_id = 0
    for _ in range(40):
        n = rng.choice([1, 2, 5, 16, 33])
        ids = list(range(next_id, next_id + n))
        rng.shuffle(ids)
        next_id += n + rng.randint(0, 3000)  # gaps: the link arrays grow inside a batch
        prints = [rng.getrandbits(62) for _ in ids] if many.wants_fingerprints else None
        for i, eid in enumerate(ids):
            one.on_insert(eid, prints[i] if prints else 0)
        many.on_insert_many(ids, prints)
        if rng.random() < 0.3:
            k = rng.randint(1, 8)
            assert [one.choose_victim(lambda e: True) for _ in range(k)] == \
                [many.choose_victim(lambda e: True) for _ in range(k)]
    assert _state(one) == _state(many.inner)  # type: ignore[attr-defined]  # with_hints gives a HintedPolicy
    assert _drain(one, lambda e: e % 3 != 0) == _drain(many, lambda e: e % 3 != 0)


def test_lru_insert_many_refuses_a_tracked_or_repeated_id_and_changes_nothing() -> None:
    p = LRUPolicy()
    p.on_insert_many([4, 2, 7])
    assert _lru_order(p) == [7, 2, 4] and len(p) == 3
    for bad in ([9, 2], [9, 9], [-1, 5]):
        with pytest.raises(ValueError):
            p.on_insert_many(bad)
        assert _lru_order(p) == [7, 2, 4] and len(p) == 3
