"""Tests of the RAM-catalog eviction policies.

Scripted tests spell out exact victim sequences; the randomized tests replay
100k operations against small pure-Python reference models of the same
algorithms (OrderedDict LRU, deque S3-FIFO) so the array-based linked lists
are checked independently of how they are implemented.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable

import pytest

from kvstore.errors import ConfigError
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.factory import POLICY_NAMES, make_policy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy


def _any(_eid: int) -> bool:
    return True


def _none(_eid: int) -> bool:
    return False


def _not_in(pinned: set[int]) -> Callable[[int], bool]:
    return lambda eid: eid not in pinned


def _drain(policy: EvictionPolicy, eligible: Callable[[int], bool] = _any) -> list[int]:
    """Victims until choose_victim returns None."""
    out: list[int] = []
    while (victim := policy.choose_victim(eligible)) is not None:
        out.append(victim)
    return out


def _insert(policy: EvictionPolicy, *eids: int) -> None:
    """Insert with fingerprint = 1000 + eid (a stable, non-zero content key)."""
    for eid in eids:
        policy.on_insert(eid, 1000 + eid)


# --------------------------------------------------------------------- LRU


def test_lru_order() -> None:
    p = LRUPolicy()
    # insert 1..4, access 2 -> victims 1, 3, 4, 2
    _insert(p, 1, 2, 3, 4)
    p.on_access(2)
    assert _drain(p) == [1, 3, 4, 2]
    assert len(p) == 0


def test_lru_access_reorders_repeatedly() -> None:
    p = LRUPolicy()
    # insert 1..5, access 1, 3, 1 (again), 5 -> victims 2, 4, 3, 1, 5
    _insert(p, 1, 2, 3, 4, 5)
    for eid in (1, 3, 1, 5):
        p.on_access(eid)
    assert _drain(p) == [2, 4, 3, 1, 5]


def test_lru_ineligible_skipped_and_kept_in_place() -> None:
    p = LRUPolicy()
    # insert 1..4, pin 1 and 3 -> victims 2, 4, then nothing eligible
    _insert(p, 1, 2, 3, 4)
    pinned = {1, 3}
    assert p.choose_victim(_not_in(pinned)) == 2
    assert p.choose_victim(_not_in(pinned)) == 4
    assert p.choose_victim(_not_in(pinned)) is None
    assert len(p) == 2 and 1 in p and 3 in p
    # insert 5, unpin -> 1 and 3 kept their (older) positions: victims 1, 3, 5
    _insert(p, 5)
    assert _drain(p) == [1, 3, 5]


def test_lru_id_reuse_after_remove() -> None:
    p = LRUPolicy()
    # insert 1, 2, 3, remove 2, insert 2 again -> 2 is now the most recent
    _insert(p, 1, 2, 3)
    p.on_remove(2)
    assert 2 not in p and len(p) == 2
    _insert(p, 2)
    assert _drain(p) == [1, 3, 2]


# ----------------------------------------------------------------- S3-FIFO


def test_s3fifo_one_hit_wonders_leave_before_accessed_entries() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..4 into S, access 1, 2
    _insert(p, 1, 2, 3, 4)
    p.on_access(1)
    p.on_access(2)
    # evicting from S: 1 and 2 were accessed -> move to M; 3 is evicted
    assert p.choose_victim(_any) == 3
    assert (p.small_len, p.main_len) == (1, 2)
    # S={4} is still >= 10% of 3 entries -> 4 goes next, then M in FIFO order
    assert _drain(p) == [4, 1, 2]
    # 3 and 4 (never accessed, evicted from S) are remembered by the ghost
    assert p.ghost_len == 2


def test_s3fifo_small_queue_share_decides_which_queue_evicts() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..10, access each once, insert 11, 12
    _insert(p, *range(1, 11))
    for eid in range(1, 11):
        p.on_access(eid)
    _insert(p, 11, 12)
    # S tail 1..10 are promoted to M (frequency reset), 11 is evicted
    assert p.choose_victim(_any) == 11
    # S={12} is 1 of 11 < 10% share -> evict from M: 1 (freq 0 after promotion)
    assert p.choose_victim(_any) == 1
    # now 1 of 10 >= 10% -> 12 leaves S; then M drains in FIFO order
    assert _drain(p) == [12, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1 (fp 101), evict it -> its fingerprint enters the ghost
    p.on_insert(1, 101)
    assert p.choose_victim(_any) == 1
    assert p.ghost_len == 1
    # insert 2 (fp 102), 3 (fp 101: ghost hit -> M), 4 (fp 104)
    p.on_insert(2, 102)
    p.on_insert(3, 101)
    p.on_insert(4, 104)
    assert (p.small_len, p.main_len) == (2, 1)
    assert p.ghost_len == 0  # a hit consumes the ghost entry
    # S={2,4} drains first, 3 (in M) last -> victims 2, 4, 3
    assert _drain(p) == [2, 4, 3]


def test_s3fifo_without_ghost_hit_is_plain_fifo() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # same script as above but 3 has a new fingerprint -> victims 2, 3, 4
    p.on_insert(1, 101)
    assert p.choose_victim(_any) == 1
    p.on_insert(2, 102)
    p.on_insert(3, 103)
    p.on_insert(4, 104)
    assert _drain(p) == [2, 3, 4]


def test_s3fifo_zero_fingerprint_is_never_remembered() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1 (fp 0), evict, insert 2 (fp 0) -> no ghost hit, 2 goes to S
    p.on_insert(1, 0)
    assert p.choose_victim(_any) == 1
    assert p.ghost_len == 0
    p.on_insert(2, 0)
    assert (p.small_len, p.main_len) == (1, 0)


def test_s3fifo_main_reinserts_with_decremented_frequency() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..3, access each, insert 4 -> 1..3 promoted to M, 4 evicted
    _insert(p, 1, 2, 3)
    for eid in (1, 2, 3):
        p.on_access(eid)
    _insert(p, 4)
    assert p.choose_victim(_any) == 4
    # M tail->head: 1, 2, 3 (all freq 0). access 1 twice (freq 2), 2 once (freq 1)
    p.on_access(1)
    p.on_access(1)
    p.on_access(2)
    # 1: freq 2->1, reinserted; 2: freq 1->0, reinserted; 3: freq 0 -> victim
    assert p.choose_victim(_any) == 3
    # 1: freq 1->0, reinserted; 2: freq 0 -> victim; then 1
    assert _drain(p) == [2, 1]


def test_s3fifo_frequency_saturates_at_three() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # 1 and 2 in M; access 1 ten times (freq capped at 3), 2 three times
    _insert(p, 1, 2)
    p.on_access(1)
    p.on_access(2)
    _insert(p, 3)
    assert p.choose_victim(_any) == 3
    for _ in range(10):
        p.on_access(1)
    for _ in range(3):
        p.on_access(2)
    # both decay 3->0 over three rotations; 1 is the tail when both reach 0
    assert _drain(p) == [1, 2]


def test_s3fifo_ineligible_small_entry_is_reinserted_at_small_head() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..3, pin 1 -> 1 would be evicted: re-inserted behind 3 instead
    _insert(p, 1, 2, 3)
    assert p.choose_victim(_not_in({1})) == 2
    assert _drain(p) == [3, 1]


def test_s3fifo_ineligible_main_entry_is_reinserted_at_main_head() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # 1..3 promoted to M (see above), pin 1 -> victims 2, then 3, 1
    _insert(p, 1, 2, 3)
    for eid in (1, 2, 3):
        p.on_access(eid)
    _insert(p, 4)
    assert p.choose_victim(_any) == 4
    assert p.choose_victim(_not_in({1})) == 2
    assert _drain(p) == [3, 1]


def test_s3fifo_falls_back_to_small_when_main_is_all_pinned() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..19, access each, insert 20, 21 -> 1..19 promoted to M, 20 evicted
    _insert(p, *range(1, 20))
    for eid in range(1, 20):
        p.on_access(eid)
    _insert(p, 20, 21)
    assert p.choose_victim(_any) == 20
    # S={21} is under its 10% share so M is tried first, but all of M is pinned
    pinned = _not_in(set(range(1, 20)))
    assert p.choose_victim(pinned) == 21
    assert p.choose_victim(pinned) is None
    assert len(p) == 19


def test_s3fifo_promoted_entry_found_after_main_fallback() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # same setup; 21 is accessed: M fails, S promotes 21 to M, M is retried
    _insert(p, *range(1, 20))
    for eid in range(1, 20):
        p.on_access(eid)
    _insert(p, 20, 21)
    assert p.choose_victim(_any) == 20
    p.on_access(21)
    assert p.choose_victim(_not_in(set(range(1, 20)))) == 21
    assert len(p) == 19


def test_s3fifo_id_reuse_starts_fresh() -> None:
    p = S3FIFOPolicy(ghost_entries=16)
    # insert 1..3, access 2, remove 2, insert 2 again (fresh, freq 0), insert 4
    _insert(p, 1, 2, 3)
    p.on_access(2)
    p.on_remove(2)
    assert 2 not in p and len(p) == 2
    _insert(p, 2, 4)
    # a stale freq on 2 would promote it and give 1, 3, 4, 2
    assert _drain(p) == [1, 3, 2, 4]
    # removal is not an eviction: a removed entry never enters the ghost
    q = S3FIFOPolicy(ghost_entries=16)
    _insert(q, 1)
    q.on_remove(1)
    assert q.ghost_len == 0


def test_s3fifo_ghost_is_bounded() -> None:
    p = S3FIFOPolicy(ghost_entries=3)
    # evict 10 one-hit wonders (fps 1001..1010): only the last 3 are kept
    _insert(p, *range(1, 11))
    assert _drain(p) == list(range(1, 11))
    assert p.ghost_len == 3
    # 1008 is remembered (M), 1007 was forgotten (S)
    p.on_insert(8, 1008)
    p.on_insert(7, 1007)
    assert (p.small_len, p.main_len) == (1, 1)


def test_s3fifo_default_ghost_bound_follows_tracked_count() -> None:
    p = S3FIFOPolicy()
    # 100 tracked; evicting 10 one-hit wonders leaves 90 tracked -> all 10 fit
    _insert(p, *range(100))
    for _ in range(10):
        p.choose_victim(_any)
    assert p.ghost_len == 10
    # draining everything shrinks the bound with the tracked count
    _drain(p)
    assert p.ghost_len == 0


def test_s3fifo_rejects_bad_options() -> None:
    with pytest.raises(ValueError):
        S3FIFOPolicy(small_fraction=0.0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(small_fraction=1.0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(ghost_entries=-1)


# ------------------------------------------------------ both policies alike


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_all_ineligible_returns_none_and_terminates(name: str) -> None:
    p = make_policy(name)
    # 50 entries with mixed frequencies (and, for S3-FIFO, some already in M)
    _insert(p, *range(50))
    for eid in range(0, 50, 3):
        for _ in range(eid % 5):
            p.on_access(eid)
    p.choose_victim(_any)
    for eid in range(1, 50, 4):
        p.on_access(eid)
    calls = 0

    def never(_eid: int) -> bool:
        nonlocal calls
        calls += 1
        return False

    assert p.choose_victim(never) is None
    assert len(p) == 49
    # each entry is asked a bounded number of times (LRU once, S3-FIFO <= 4+1)
    assert calls <= 5 * len(p)
    assert make_policy(name).choose_victim(_any) is None  # empty policy


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_implements_interface_and_len_is_exact(name: str) -> None:
    p = make_policy(name)
    assert isinstance(p, EvictionPolicy)
    assert p.name == name
    # insert 0..99, remove the evens -> 50 tracked
    _insert(p, *range(100))
    assert len(p) == 100
    for eid in range(0, 100, 2):
        p.on_remove(eid)
    p.on_remove(0)  # idempotent
    p.on_access(0)  # untracked: ignored
    p.on_access(-1)
    assert len(p) == 50
    assert 0 not in p and 1 in p and -1 not in p and 10**9 not in p and "1" not in p
    # reinsert a removed id, double insert and negative ids are rejected
    _insert(p, 0)
    with pytest.raises(ValueError):
        _insert(p, 0)
    with pytest.raises(ValueError):
        p.on_insert(-1)
    assert len(p) == 51
    # every victim is forgotten and len drops by exactly one
    seen: set[int] = set()
    while len(p):
        before = len(p)
        victim = p.choose_victim(_any)
        assert victim is not None and victim not in p and victim not in seen
        seen.add(victim)
        assert len(p) == before - 1
    assert seen == set(range(1, 100, 2)) | {0}
    assert p.memory_bytes() > 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_sparse_ids_grow_capacity(name: str) -> None:
    p = make_policy(name, initial_capacity=4)
    before = p.memory_bytes()
    _insert(p, 3, 5000, 1)
    assert len(p) == 3 and 5000 in p and 4 not in p
    assert p.memory_bytes() > before
    assert _drain(p) == [3, 5000, 1]


def test_factory_rejects_unknown_name() -> None:
    with pytest.raises(ConfigError) as info:
        make_policy("arc")
    assert str(info.value) == "invalid config: policy='arc': use one of lru, s3fifo"
    with pytest.raises(ConfigError, match=r"policy 's3fifo' options \{'small_fraction': 0.0\}: .*small_fraction"):
        make_policy("s3fifo", small_fraction=0.0)  # the constructor's ValueError, as the config error it is
    assert set(POLICY_NAMES) == {"lru", "s3fifo"}
    assert isinstance(make_policy("s3fifo", small_fraction=0.2), S3FIFOPolicy)
    assert isinstance(make_policy("lru"), LRUPolicy)


def test_package_reexports() -> None:
    import kvstore.policies as pkg

    assert sorted(pkg.__all__) == sorted(
        ["EvictionPolicy", "LRUPolicy", "S3FIFOPolicy", "POLICY_NAMES", "make_policy"]
    )
    assert all(hasattr(pkg, name) for name in pkg.__all__)
    assert pkg.make_policy is make_policy


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
            eligible = _not_in(pinned)
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


# ----------------------------------------------------------------- memory


@pytest.mark.parametrize(("name", "budget"), [("lru", 16), ("s3fifo", 24)])
def test_memory_budget_at_one_million_ids(name: str, budget: int) -> None:
    n = 1_000_000
    p = make_policy(name)
    for eid in range(n):
        p.on_insert(eid, eid + 1)
    assert len(p) == n
    assert p.memory_bytes() <= budget * n
    if isinstance(p, S3FIFOPolicy):
        # the ghost is bounded to 65536 fingerprints by default
        for _ in range(70_000):
            p.choose_victim(_any)
        assert p.ghost_len == 65536
        assert p.ghost_memory_bytes() <= 16 * 2**20
