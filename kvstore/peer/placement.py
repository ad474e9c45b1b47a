"""Who owns a block: rendezvous (highest random weight) hashing of (namespace, key) over the live members.

Why HRW and not a ring: scoring every member per key needs no virtual nodes, and when a member joins or leaves
only the keys it owns (or now wins) move. Every node computes the same ranking from the same member set, so no
node needs to ask anyone where a block lives. It also makes a membership change easy to reason about
(change.py, handoff.py): a member that joins takes only the keys it now wins, each from the member it
outranks, which stays second; a member that leaves gives each of its keys to the member ranked next, which
under `owner+1` already holds the replica.

The score of member m for a block: mix64(xxh3_64(namespace NUL key) XOR xxh3_64(node id)), mix64 being
splitmix64's finalizer (a bijection with full avalanche), in wrapping uint64 arithmetic; ties (probability
2^-64) go to the greater node id. Stable across processes and restarts (never Python's hash()). Why not one
xxh3 call per (key, member) pair, seeded by the member: a 1,024-node cluster then costs 1,024 Python-level
hash calls per key (0.66 ms a key here: 186 ms for a 280-key prefix Lookup); this costs one xxh3 per key and
one vectorised pass over a (keys x members) matrix (bench.cluster.scale has the figures). Every function takes a
batch of keys for that reason; the one-key forms are for tests and tools.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from functools import lru_cache

import numpy as np
import xxhash

__all__ = ["rank", "owners", "owners_of", "handoff_targets", "handoff_targets_of", "read_order", "read_orders"]

_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_CHUNK = 1 << 16  # matrix cells scored at once (keys x members), so memory stays bounded at any size


@lru_cache(maxsize=64)
def _members(members: frozenset[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """The members in id order and their hashes (cached per member set: sets change rarely)."""
    ids = tuple(sorted(members))
    return ids, np.array([xxhash.xxh3_64_intdigest(m.encode()) for m in ids], dtype=np.uint64)


def _key_hashes(namespace: str, keys: Sequence[bytes]) -> np.ndarray:
    prefix = namespace.encode() + b"\x00"
    return np.fromiter((xxhash.xxh3_64_intdigest(prefix + k) for k in keys), dtype=np.uint64, count=len(keys))


def _scores(kh: np.ndarray, mh: np.ndarray) -> np.ndarray:
    """(keys x members) scores: splitmix64's finalizer of key hash XOR member hash, wrapping."""
    x = kh[:, None] ^ mh[None, :]
    x ^= x >> _S30
    x *= _C1
    x ^= x >> _S27
    x *= _C2
    x ^= x >> _S31
    return x


def _ranked(namespace: str, keys: Sequence[bytes], members: Collection[str], depth: int) -> list[list[str]]:
    """Per key, its `depth` best-ranked members, best first."""
    ids, mh = _members(members if isinstance(members, frozenset) else frozenset(members))
    n = len(ids)
    depth = min(depth, n)
    if not keys or depth <= 0:
        return [[] for _ in keys]
    out: list[list[str]] = []
    step = max(1, _CHUNK // n)
    for lo in range(0, len(keys), step):
        s = _scores(_key_hashes(namespace, keys[lo:lo + step]), mh)
        if depth == 1:
            best = np.argmax(s[:, ::-1], axis=1)  # reversed: a tie goes to the greater id (the later column)
            out.extend([ids[n - 1 - int(b)]] for b in best)
            continue
        # ~s sorts the best score first; columns in reverse id order, so a stable sort gives a tie to the greater
        # id; only the best `depth` columns are sorted (argpartition first) when that is fewer than all
        inv = ~s[:, ::-1]
        if depth < n:
            top = np.argpartition(inv, depth - 1, axis=1)[:, :depth]
            top.sort(axis=1)  # column order again, for the stable tie-break below
            order = np.take_along_axis(top, np.argsort(np.take_along_axis(inv, top, axis=1), axis=1,
                                                       kind="stable"), axis=1)
        else:
            order = np.argsort(inv, axis=1, kind="stable")
        out.extend([ids[n - 1 - int(c)] for c in row[:depth]] for row in order)
    return out


def rank(namespace: str, key: bytes, members: Iterable[str]) -> list[str]:
    """Members ordered by their score for this block, best (the owner) first."""
    ms = frozenset(members)
    return _ranked(namespace, [key], ms, len(ms))[0]


def owners_of(namespace: str, keys: Sequence[bytes], members: Collection[str], copies: int) -> list[list[str]]:
    """Per key, its `copies` best-ranked members (owner first); fewer when there are fewer members."""
    return _ranked(namespace, keys, members, copies)


def owners(namespace: str, key: bytes, members: Collection[str], copies: int) -> list[str]:
    """owners_of for one key."""
    return _ranked(namespace, [key], members, copies)[0]


def handoff_targets_of(namespace: str, keys: Sequence[bytes], before: Collection[str], after: Collection[str],
                       copies: int, me: str, via: Sequence[Collection[str]] = ()) -> list[list[str]]:
    """Per key this node holds, the members it hands the block to when the member set went from `before`
    (through the sets `via`, when changes were composed into one pass) to `after`. Earlier sets: `before` and
    `via`. This node is responsible for a block when it owned it under an earlier set, or when none of its
    owners under any earlier set is in `after` (then every holder sends; the target's answer to a probe keeps
    bytes it has from crossing again). A responsible node that does not own the block under `after` hands it
    to every owner under `after`; one that does, to the owners under `after` that owned it under no earlier set
    (a replica to restore after a death). A copy this node never owned (a writer's, a reader's) moves only
    when no earlier owner survived: otherwise that owner holds the block, or evicted it, and a stray copy
    pushed back would evict something hotter at the owner."""
    if copies <= 0:
        return [[] for _ in keys]
    after_set = after if isinstance(after, frozenset) else frozenset(after)
    earlier = [_ranked(namespace, keys, s, copies) for s in (before, *via)]
    out: list[list[str]] = []
    for i, new in enumerate(_ranked(namespace, keys, after_set, copies)):
        old = {m for ranked in earlier for m in ranked[i]}
        if not (me in old or not old & after_set):
            out.append([])
        elif me not in new:
            out.append(list(new))
        else:
            out.append([m for m in new if m not in old and m != me])
    return out


def handoff_targets(namespace: str, key: bytes, before: Collection[str], after: Collection[str], copies: int,
                    me: str, via: Sequence[Collection[str]] = ()) -> list[str]:
    """handoff_targets_of for one key."""
    return handoff_targets_of(namespace, [key], before, after, copies, me, via)[0]


def read_orders(namespace: str, keys: Sequence[bytes], current: Collection[str],
                previous: Sequence[Collection[str]], copies: int, me: str,
                reachable: Collection[str] | None = None) -> list[list[str]]:
    """Per key this node does not hold, whom it asks, in order: the owner under the current member set (or,
    when that is this node, the replica under `owner+1`), then the owners under each earlier member set of the
    hand-off window (`previous`, newest first) that are still reachable (`reachable`: the current set, and
    members that are leaving and still serve): until a hand-off lands, the block is where it was."""
    cur = current if isinstance(current, frozenset) else frozenset(current)
    can_ask = cur if reachable is None else frozenset(reachable)
    depth = max(1, copies)
    heads = _ranked(namespace, keys, cur, depth)
    earlier = [_ranked(namespace, keys, p, depth) for p in previous]
    out = []
    for i, head in enumerate(heads):
        order: list[str] = []
        if head and head[0] != me:
            order.append(head[0])
        elif copies >= 2 and len(head) > 1:
            order.append(head[1])
        for ranked in earlier:
            for m in ranked[i]:
                if m != me and m in can_ask and m not in order:
                    order.append(m)
        out.append(order)
    return out


def read_order(namespace: str, key: bytes, current: Collection[str], previous: Sequence[Collection[str]],
               copies: int, me: str, reachable: Collection[str] | None = None) -> list[str]:
    """read_orders for one key."""
    return read_orders(namespace, [key], current, previous, copies, me, reachable)[0]
