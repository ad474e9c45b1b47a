"""Eviction policies of the RAM catalog (decide only: no I/O, no locks)."""

from __future__ import annotations

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.factory import POLICY_NAMES, make_policy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy

__all__ = [
    "POLICY_NAMES",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "make_policy",
]
