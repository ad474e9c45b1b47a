"""Tests of the RAM-catalog eviction policies: LRU's exact victim sequences, what every policy does alike
(interface, exact len, all pinned, sparse ids, the factory), and the memory budget per tracked id.

Scripted tests spell out exact victim sequences (helpers: tests/policy_helpers.py). S3-FIFO's scripts:
test_policies_s3fifo.py; 100k random operations against pure-Python reference models:
test_policies_reference.py.
"""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.factory import POLICY_NAMES, make_policy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy
from tests.policy_helpers import drain, eligible_any, eligible_unless, insert


# --------------------------------------------------------------------- LRU


def test_lru_order() -> None:
    p = LRUPolicy()
    # insert 1..4, access 2 -> victims 1, 3, 4, 2
    insert(p, 1, 2, 3, 4)
    p.on_access(2)
    assert drain(p) == [1, 3, 4, 2]
    assert len(p) == 0


def test_lru_access_reorders_repeatedly() -> None:
    p = LRUPolicy()
    # insert 1..5, access 1, 3, 1 (again), 5 -> victims 2, 4, 3, 1, 5
    insert(p, 1, 2, 3, 4, 5)
    for eid in (1, 3, 1, 5):
        p.on_access(eid)
    assert drain(p) == [2, 4, 3, 1, 5]


def test_lru_ineligible_skipped_and_kept_in_place() -> None:
    p = LRUPolicy()
    # insert 1..4, pin 1 and 3 -> victims 2, 4, then nothing eligible
    insert(p, 1, 2, 3, 4)
    pinned = {1, 3}
    assert p.choose_victim(eligible_unless(pinned)) == 2
    assert p.choose_victim(eligible_unless(pinned)) == 4
    assert p.choose_victim(eligible_unless(pinned)) is None
    assert len(p) == 2 and 1 in p and 3 in p
    # insert 5, unpin -> 1 and 3 kept their (older) positions: victims 1, 3, 5
    insert(p, 5)
    assert drain(p) == [1, 3, 5]


def test_lru_id_reuse_after_remove() -> None:
    p = LRUPolicy()
    # insert 1, 2, 3, remove 2, insert 2 again -> 2 is now the most recent
    insert(p, 1, 2, 3)
    p.on_remove(2)
    assert 2 not in p and len(p) == 2
    insert(p, 2)
    assert drain(p) == [1, 3, 2]


# ------------------------------------------------------ both policies alike


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_all_ineligible_returns_none_and_terminates(name: str) -> None:
    p = make_policy(name)
    # 50 entries with mixed frequencies (and, for S3-FIFO, some already in M)
    insert(p, *range(50))
    for eid in range(0, 50, 3):
        for _ in range(eid % 5):
            p.on_access(eid)
    p.choose_victim(eligible_any)
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
    assert make_policy(name).choose_victim(eligible_any) is None  # empty policy


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_implements_interface_and_len_is_exact(name: str) -> None:
    p = make_policy(name)
    assert isinstance(p, EvictionPolicy)
    assert p.name == name
    # insert 0..99, remove the evens -> 50 tracked
    insert(p, *range(100))
    assert len(p) == 100
    for eid in range(0, 100, 2):
        p.on_remove(eid)
    p.on_remove(0)  # idempotent
    p.on_access(0)  # untracked: ignored
    p.on_access(-1)
    assert len(p) == 50
    assert 0 not in p and 1 in p and -1 not in p and 10**9 not in p and "1" not in p
    # reinsert a removed id, double insert and negative ids are rejected
    insert(p, 0)
    with pytest.raises(ValueError):
        insert(p, 0)
    with pytest.raises(ValueError):
        p.on_insert(-1)
    assert len(p) == 51
    # every victim is forgotten and len drops by exactly one
    seen: set[int] = set()
    while len(p):
        before = len(p)
        victim = p.choose_victim(eligible_any)
        assert victim is not None and victim not in p and victim not in seen
        seen.add(victim)
        assert len(p) == before - 1
    assert seen == set(range(1, 100, 2)) | {0}
    assert p.memory_bytes() > 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_sparse_ids_grow_capacity(name: str) -> None:
    p = make_policy(name, initial_capacity=4)
    before = p.memory_bytes()
    insert(p, 3, 5000, 1)
    assert len(p) == 3 and 5000 in p and 4 not in p
    assert p.memory_bytes() > before
    assert drain(p) == [3, 5000, 1]


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
            p.choose_victim(eligible_any)
        assert p.ghost_len == 65536
        assert p.ghost_memory_bytes() <= 16 * 2**20
