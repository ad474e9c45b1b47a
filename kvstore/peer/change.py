"""A membership change as a value, and the recent member sets every placement question reads.

    MemberChange(before, after)  what one change did: joined = after - before, left = before - after. The
                                 membership watch (membership.py) makes one per change it sees; placement,
                                 hand-off (handoff.py) and reads (remote_tier.py) consume it. compose() folds
                                 a later change into an earlier one that has not been acted on yet.
    MemberView                   the current member ids and the earlier member sets of the hand-off window
                                 (`window_s`, newest first). Reads ask a block's current owner first and then
                                 its owners under those earlier sets (placement.read_order): a block is where it
                                 was until its hand-off lands. A receiver takes a hand-off only for blocks it
                                 owns under the current set, one step past it (the successor of a node that
                                 is leaving and has not yet left), or an earlier set of the window (accepts()).

Settling: a node that has handed off everything it holds for the current set (handoff.py: a pass with nothing
left undelivered, then a catch-up pass over what landed during a grace after it) says so with a settle marker
in etcd named by set_digest(the set) (membership.py). Once every member of the current set has one, no earlier
owner holds a block that the current owners lack, so reads stop asking previous owners before the window ends
(PeerCluster.read_previous): a miss costs one probe per owner again, not one per earlier set. The intake keeps
the whole window (a late hand-off from a node that saw a change after this one is still taken).

A block's life across nodes (what the peer tier promises; docs/peer-tier.md has the figures):

    put on W ──push──► OWNED at O (and, under owner+1, at the replica R); W keeps its copy in its own tiers
       │
       ├─ X joins and outranks O  ─► O hands it to X (background, bounded rate); until it lands a read that
       │                             misses at X asks O (the previous owner, read_order)
       ├─ O leaves (SIGTERM)      ─► O hands it to the next-ranked member before it revokes its lease
       ├─ O dies (kill -9)        ─► R (owner+1) is the owner now and holds it; R re-replicates to the new
       │                             replica. Without a replica the survivors that hold it (W) hand it to the
       │                             new owner once etcd drops O (its lease TTL)
       └─ evicted everywhere      ─► gone (a miss; recomputed)

Thread-safe: the membership thread applies changes, reads come from any thread.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from kvstore.peer.placement import owners_of, read_orders

__all__ = ["MemberChange", "MemberView", "set_digest"]


def set_digest(members: Collection[str]) -> str:
    """A member set's name in settle markers (membership.py): 16 hex digits of blake2b over the sorted ids, so
    every node names the same set alike whatever order it learned the members in."""
    return hashlib.blake2b("\n".join(sorted(members)).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class MemberChange:
    before: frozenset[str]
    after: frozenset[str]
    via: tuple[frozenset[str], ...] = ()  # the sets in between, when changes were composed (oldest first)

    @property
    def joined(self) -> frozenset[str]:
        return self.after - self.before

    @property
    def left(self) -> frozenset[str]:
        return self.before - self.after

    def compose(self, later: MemberChange) -> MemberChange:
        """This change followed by `later` (whose before is this one's after), as one change that remembers the
        sets in between (a node that owned a block only under one of them still hands it on)."""
        return MemberChange(self.before, later.after, (*self.via, self.after, *later.via))

    def describe(self) -> str:
        parts = [f"+{m}" for m in sorted(self.joined)] + [f"-{m}" for m in sorted(self.left)]
        return " ".join(parts) or "no change"


class MemberView:
    def __init__(self, me: str, copies: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.me = me
        self.copies = copies
        self._window = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._current: frozenset[str] = frozenset({me})
        self._digest = set_digest(self._current)
        self._epoch = 0  # one more at every change: a set that comes back (a node leaves and rejoins) is a new epoch
        self._earlier: list[tuple[float, frozenset[str]]] = []  # (time it stopped being current, set), newest first

    def apply(self, members: Iterable[str]) -> MemberChange | None:
        """Make `members` (the placement set: members that are not leaving) the current set; the change, or
        None when nothing changed."""
        after = frozenset(members)
        now = self._clock()
        with self._lock:
            before = self._current
            if after == before:
                return None
            if before != {self.me}:
                self._earlier.insert(0, (now, before))
            elif len(after) > 1:
                # this node alone is its view before it first reads etcd, not a cluster's: the cluster it joined
                # is the set without it, and that is where the blocks it now owns are until they are handed over
                self._earlier.insert(0, (now, after - {self.me}))
            self._current = after
            self._digest = set_digest(after)
            self._epoch += 1
            self._trim(now)
        return MemberChange(before, after)

    def _trim(self, now: float) -> None:
        self._earlier = [(t, s) for t, s in self._earlier if now - t <= self._window][:16]

    def current(self) -> frozenset[str]:
        with self._lock:
            return self._current

    def state(self) -> tuple[frozenset[str], str, int]:
        """The current set, its set_digest and its epoch (changes applied so far), read together."""
        with self._lock:
            return self._current, self._digest, self._epoch

    def previous(self) -> list[frozenset[str]]:
        """The member sets of the hand-off window before the current one, newest first."""
        with self._lock:
            self._trim(self._clock())
            return [s for _, s in self._earlier]

    def read_orders(self, namespace: str, keys: Sequence[bytes],
                    reachable: Collection[str] | None = None) -> list[list[str]]:
        """placement.read_orders over this view."""
        return read_orders(namespace, keys, self.current(), self.previous(), self.copies, self.me, reachable)

    def accepts(self, namespace: str, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether this node takes a block handed to it: it owns the block under the current member set,
        or one rank past it (a member that is leaving hands its blocks over before it leaves the set), or under
        an earlier set of the window (a sender that saw a change this node has not seen yet, or the reverse)."""
        copies, me = max(1, self.copies), self.me
        out = [me in o for o in owners_of(namespace, keys, self.current(), copies + 1)]
        for s in self.previous():
            if all(out):
                break
            out = [ok or me in o for ok, o in zip(out, owners_of(namespace, keys, s, copies))]
        return out
