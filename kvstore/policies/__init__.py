"""Eviction policies of the RAM catalog (decide only: no I/O, no locks), and disk admission.

    base.py       the eviction-policy interface: each primitive's contract, complexity and idempotence
    lru.py        exact LRU as an intrusive doubly-linked list in two int32 arrays
    s3fifo.py     S3-FIFO (Yang et al., SOSP'23) over dense entry ids
    factory.py    a policy from its configured name (`policy = "lru" | "s3fifo"`)
    hinted.py     priorities and expiries over any policy: Retain (skip until a deadline), Release (first to go)
    admission.py  disk admission: which RAM blocks deserve a copy on the SSD (`always`, `seen:N`, `never`), and
                  when it is written (`disk_write`: `commit` or `evict`)
    write_budget.py  the disk write budget: random admission at a byte rate, larger blocks refused first
"""

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
