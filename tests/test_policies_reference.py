"""The eviction policies against small pure-Python reference models of the same algorithms (OrderedDict LRU,
deque S3-FIFO): 100k random operations replayed on both, so the array-based linked lists are checked
independently of how they are implemented.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable


from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy
from tests.policy_helpers import eligible_unless


# -------------------------------------------------------- reference models


class RefLRU:
    """OrderedDict LRU: first key is the least recent."""

    def __init__(self) -> None:
        self.od: OrderedDict[int, None] = OrderedDict()

    def insert(self, eid: int, fp: int) -> None:
        self.od[eid] = None

    def access(self, eid: int) -> None:
        if eid in self.od:
            self.od.move_to_end(eid)

    def remove(self, eid: int) -> None:
        self.od.pop(eid, None)

    def choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        for eid in self.od:
            if eligible(eid):
                del self.od[eid]
                return eid
        return None

    def __len__(self) -> int:
        return len(self.od)


class RefS3FIFO:
    """Deque S3-FIFO: appendleft is the queue head, pop() takes the tail."""

    def __init__(self, small_fraction: float = 0.1, ghost_entries: int | None = None) -> None:
        self.frac = small_fraction
        self.ghost_entries = ghost_entries
        self.small: deque[int] = deque()
        self.main: deque[int] = deque()
        self.freq: dict[int, int] = {}
        self.fp: dict[int, int] = {}
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def insert(self, eid: int, fp: int) -> None:
        fp &= (1 << 64) - 1
        self.freq[eid] = 0
        self.fp[eid] = fp
        if fp and fp in self.ghost:
            del self.ghost[fp]
            self.main.appendleft(eid)
        else:
            self.small.appendleft(eid)

    def access(self, eid: int) -> None:
        if eid in self.freq:
            self.freq[eid] = min(self.freq[eid] + 1, 3)

    def remove(self, eid: int) -> None:
        if eid in self.freq:
            (self.small if eid in self.small else self.main).remove(eid)
            del self.freq[eid], self.fp[eid]

    def __len__(self) -> int:
        return len(self.freq)

    def _forget(self, eid: int) -> None:
        del self.freq[eid], self.fp[eid]

    def _remember(self, fp: int) -> None:
        limit = self.ghost_entries if self.ghost_entries is not None else min(len(self), 65536)
        if limit <= 0:
            self.ghost.clear()
            return
        self.ghost.pop(fp, None)
        self.ghost[fp] = None
        while len(self.ghost) > limit:
            self.ghost.popitem(last=False)

    def _evict_small(self, eligible: Callable[[int], bool]) -> int | None:
        for _ in range(len(self.small)):
            eid = self.small.pop()
            if self.freq[eid] > 0:
                self.freq[eid] = 0
                self.main.appendleft(eid)
            elif eligible(eid):
                fp = self.fp[eid]
                self._forget(eid)
                if fp:
                    self._remember(fp)
                return eid
            else:
                self.small.appendleft(eid)
        return None

    def _evict_main(self, eligible: Callable[[int], bool]) -> int | None:
        while True:
            decayed = False
            for _ in range(len(self.main)):
                eid = self.main.pop()
                if self.freq[eid] > 0:
                    self.freq[eid] -= 1
                    decayed = True
                elif eligible(eid):
                    self._forget(eid)
                    return eid
                self.main.appendleft(eid)
            if not decayed:
                return None

    def choose_victim(self, eligible: Callable[[int], bool]) -> int | None:
        n_small, n_main = len(self.small), len(self.main)
        if n_small and (n_small >= self.frac * (n_small + n_main) or not n_main):
            victim = self._evict_small(eligible)
            return victim if victim is not None else self._evict_main(eligible)
        victim = self._evict_main(eligible)
        if victim is None:
            before = len(self.main)
            victim = self._evict_small(eligible)
            if victim is None and len(self.main) != before:
                victim = self._evict_main(eligible)
        return victim


def _cross_check(policy: EvictionPolicy, ref: RefLRU | RefS3FIFO, seed: int) -> None:
    """100k random operations; victims, len and membership must agree."""
    rng = random.Random(seed)
    n_ids = 200
    tracked: set[int] = set()
    pinned: set[int] = set()
    victims = 0
    for step in range(100_000):
        op = rng.random()
        if op < 0.30:
            free = rng.randrange(n_ids)
            if free not in tracked:
                # fingerprints from a small pool so ghost hits are common;
                # 0 (no fingerprint) and negatives (taken mod 2**64) included
                fp = rng.choice((0, -1, rng.randrange(1, 400)))
                policy.on_insert(free, fp)
                ref.insert(free, fp)
                tracked.add(free)
        elif op < 0.60:
            eid = rng.randrange(n_ids)  # sometimes untracked: ignored by both
            policy.on_access(eid)
            ref.access(eid)
        elif op < 0.70:
            eid = rng.randrange(n_ids)
            policy.on_remove(eid)
            ref.remove(eid)
            tracked.discard(eid)
        elif op < 0.72:
            # re-draw the leased set: none, a few, or nearly everything
            pinned = set(rng.sample(range(n_ids), rng.choice((0, 5, 40, 195, n_ids))))
        else:
            eligible = eligible_unless(pinned)
            victim = policy.choose_victim(eligible)
            assert victim == ref.choose_victim(eligible), f"step {step}"
            if victim is not None:
                assert victim not in pinned
                tracked.discard(victim)
                victims += 1
        assert len(policy) == len(ref) == len(tracked), f"step {step}"
        if step % 997 == 0:
            assert all((eid in policy) == (eid in tracked) for eid in range(n_ids))
    assert victims > 10_000


def test_lru_matches_reference_model() -> None:
    _cross_check(LRUPolicy(initial_capacity=8), RefLRU(), seed=1)


def test_s3fifo_matches_reference_model_default_ghost() -> None:
    _cross_check(S3FIFOPolicy(initial_capacity=8), RefS3FIFO(), seed=2)


def test_s3fifo_matches_reference_model_small_ghost() -> None:
    # a tiny ghost forces trimming and ring compaction with stale slots
    policy = S3FIFOPolicy(small_fraction=0.25, ghost_entries=7)
    _cross_check(policy, RefS3FIFO(small_fraction=0.25, ghost_entries=7), seed=3)
