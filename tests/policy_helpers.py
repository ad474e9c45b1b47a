"""Shared helpers of the eviction-policy tests (tests/test_policies*.py): eligibility predicates, draining every
victim, inserting with a stable fingerprint.

Why a module: the scripted LRU and S3-FIFO tests and the cross-checks against reference models all spell out
victim sequences the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.policies.base import EvictionPolicy

__all__ = ["eligible_any", "eligible_none", "eligible_unless", "drain", "insert"]


def eligible_any(_eid: int) -> bool:
    return True


def eligible_none(_eid: int) -> bool:
    return False


def eligible_unless(pinned: set[int]) -> Callable[[int], bool]:
    return lambda eid: eid not in pinned


def drain(policy: EvictionPolicy, eligible: Callable[[int], bool] = eligible_any) -> list[int]:
    """Victims until choose_victim returns None."""
    out: list[int] = []
    while (victim := policy.choose_victim(eligible)) is not None:
        out.append(victim)
    return out


def insert(policy: EvictionPolicy, *eids: int) -> None:
    """Insert with fingerprint = 1000 + eid (a stable, non-zero content key)."""
    for eid in eids:
        policy.on_insert(eid, 1000 + eid)
