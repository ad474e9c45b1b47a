"""Who owns a block: rendezvous (highest random weight) hashing of (namespace, key) over the live members.

Why HRW and not a ring: with a handful of members, scoring every member per key is a few xxh3 calls, needs no
virtual nodes, and when a member joins or leaves only the keys it owns (or now wins) move. Every node computes
the same ranking from the same member set, so no node needs to ask anyone where a block lives. The score is
xxh3_64(namespace NUL key) seeded by a digest of the node id: stable across processes and restarts (never
Python's hash()).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import xxhash

__all__ = ["rank", "owners"]


@lru_cache(maxsize=4096)
def _seed(node_id: str) -> int:
    return xxhash.xxh3_64_intdigest(node_id.encode())


def rank(namespace: str, key: bytes, members: Iterable[str]) -> list[str]:
    """Members ordered by their score for this block, best (the owner) first; ties broken by node id."""
    item = namespace.encode() + b"\x00" + key
    return sorted(members, key=lambda m: (xxhash.xxh3_64_intdigest(item, seed=_seed(m)), m), reverse=True)


def owners(namespace: str, key: bytes, members: Sequence[str], copies: int) -> list[str]:
    """The `copies` best-ranked members (owner first); fewer when there are fewer members."""
    return rank(namespace, key, members)[:copies]
