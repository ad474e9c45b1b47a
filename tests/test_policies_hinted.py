"""HintedPolicy (kvstore/policies/hinted.py) on its own: the priority classes over LRU and S3-FIFO, with an
explicit clock, ineligible entries, reused ids and the released deque's bound."""

from __future__ import annotations

import pytest

from kvstore.policies import make_policy
from kvstore.policies.hinted import NORMAL, RELEASED, RETAINED, HintedPolicy, with_hints

POLICIES = ["lru", "s3fifo"]


def filled(policy: str, n: int = 6) -> tuple[HintedPolicy, list[float]]:
    now = [100.0]
    p = HintedPolicy(make_policy(policy), clock=lambda: now[0])
    for eid in range(n):
        p.on_insert(eid, eid + 1)
    return p, now


def drain(p: HintedPolicy, eligible=lambda e: True) -> list[int]:
    out = []
    while (v := p.choose_victim(eligible)) is not None:
        out.append(v)
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_released_first_then_normal_then_retained(policy: str) -> None:
    p, _ = filled(policy)
    assert p.set_priority(0, RETAINED, 150.0) and p.set_priority(1, RETAINED, 150.0)
    assert p.set_priority(4, RELEASED) and p.set_priority(3, RELEASED)
    assert (p.priority(0), p.priority(4), p.priority(2)) == (RETAINED, RELEASED, NORMAL)
    assert drain(p) == [4, 3, 2, 5, 0, 1]
    assert len(p) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_expired_retention_is_normal(policy: str) -> None:
    p, now = filled(policy, 3)
    p.set_priority(0, RETAINED, 150.0)
    now[0] = 150.0
    assert p.priority(0) == NORMAL
    assert p.choose_victim(lambda e: True) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_an_ineligible_released_entry_keeps_its_place(policy: str) -> None:
    p, _ = filled(policy, 4)
    p.set_priority(2, RELEASED)
    p.set_priority(3, RELEASED)
    assert p.choose_victim(lambda e: e != 2) == 3
    assert p.choose_victim(lambda e: True) == 2  # still first to go once eligible


@pytest.mark.parametrize("policy", POLICIES)
def test_removal_and_reuse_clear_the_priority(policy: str) -> None:
    p, _ = filled(policy, 3)
    assert p.set_priority(7, RETAINED, 150.0) is False  # untracked: ignored
    p.set_priority(1, RELEASED)
    p.on_remove(1)
    assert p.priority(1) == NORMAL and 1 not in p
    p.on_insert(1, 99)  # the id reused by another block: normal, the newest
    assert drain(p) == [0, 2, 1]


def test_the_released_deque_stays_bounded() -> None:
    p, _ = filled("lru", 4)
    for _ in range(1000):
        p.set_priority(0, RELEASED)
        p.set_priority(0, NORMAL)
    assert len(p._released) <= 2 * p._n_released + 64 + 1
    with pytest.raises(ValueError, match="priority 5 unknown"):
        p.set_priority(0, 5)


def test_with_hints_wraps_once_and_keeps_the_name() -> None:
    inner = make_policy("s3fifo")
    p = with_hints(inner)
    assert with_hints(p) is p and p.inner is inner and p.name == "s3fifo"
    p.on_insert(0, 1)
    p.set_priority(0, RETAINED, 1e18)
    assert p.memory_bytes() == inner.memory_bytes() + 64 * 9
