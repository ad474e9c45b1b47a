"""Who owns a block: rendezvous (highest random weight) hashing of (namespace, key) over the live members.

Why HRW and not a ring: with a handful of members, scoring every member per key is a few xxh3 calls, needs no
virtual nodes, and when a member joins or leaves only the keys it owns (or now wins) move. Every node computes
the same ranking from the same member set, so no node needs to ask anyone where a block lives. The score is
xxh3_64(namespace NUL key) seeded by a digest of the node id: stable across processes and restarts (never
Python's hash()).

HRW also makes a membership change cheap to reason about (change.py, handoff.py): a member that joins takes
only the keys it now wins, each from the member it outranks, which stays second; a member that leaves gives
each of its keys to the member ranked next, which under `owner+1` already holds the replica.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Sequence
from functools import lru_cache

import xxhash

__all__ = ["rank", "owners", "handoff_targets", "read_order"]


@lru_cache(maxsize=4096)
def _seed(node_id: str) -> int:
    return xxhash.xxh3_64_intdigest(node_id.encode())


def _item(namespace: str, key: bytes) -> bytes:
    return namespace.encode() + b"\x00" + key


def rank(namespace: str, key: bytes, members: Iterable[str]) -> list[str]:
    """Members ordered by their score for this block, best (the owner) first; ties broken by node id."""
    item = _item(namespace, key)
    return sorted(members, key=lambda m: (xxhash.xxh3_64_intdigest(item, seed=_seed(m)), m), reverse=True)


def owners(namespace: str, key: bytes, members: Iterable[str], copies: int) -> list[str]:
    """The `copies` best-ranked members (owner first); fewer when there are fewer members. The same order as
    rank()'s head, in O(members) rather than a sort (a 1,024-node cluster scores every member per key)."""
    if copies <= 0:
        return []
    item = _item(namespace, key)
    return heapq.nlargest(copies, members, key=lambda m: (xxhash.xxh3_64_intdigest(item, seed=_seed(m)), m))


def handoff_targets(namespace: str, key: bytes, before: Collection[str], after: Collection[str], copies: int,
                    me: str) -> list[str]:
    """The members this node hands a block it holds to when the member set goes from `before` to `after`:
    the block's owners under `after` that were not owners under `before` (each gets it once), when this node is
    responsible for moving it. Responsible: this node was one of its owners, or none of its owners survived
    (then every holder sends, the writer among them, and the target's answer to a probe keeps the bytes from
    crossing twice). Others hold copies they fetched or wrote; an owner moves those for them."""
    if copies <= 0:
        return []
    old = owners(namespace, key, before, copies)
    new = owners(namespace, key, after, copies)
    targets = [m for m in new if m not in old and m != me]
    if not targets:
        return []
    if me in old or not any(m in after for m in old):
        return targets
    return []


def read_order(namespace: str, key: bytes, current: Collection[str], previous: Sequence[Collection[str]],
               copies: int, me: str) -> list[str]:
    """Whom a node asks for a block it does not hold, in order: the owner under the current member set (or,
    when that is this node, the replica under `owner+1`), then the owners under each earlier member set of the
    hand-off window (`previous`, newest first) that are still members: until a hand-off lands, the block is
    where it was."""
    out: list[str] = []
    head = owners(namespace, key, current, max(1, copies))
    if head and head[0] != me:
        out.append(head[0])
    elif copies >= 2 and len(head) > 1:
        out.append(head[1])
    for members in previous:
        for m in owners(namespace, key, members, max(1, copies)):
            if m != me and m in current and m not in out:
                out.append(m)
    return out
