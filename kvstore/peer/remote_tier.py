"""Reads from peers: on a local RAM + disk miss, ask each missing block's owner, one batched call per peer.

`fill(namespace, keys)` runs at the start of an engine Lookup (no engine lock held): it finds the keys this
node does not hold, routes each to its owner by rendezvous hashing (or, under `owner+1`, to the replica when
this node is the owner), and fetches every peer's batch in parallel. The data plane lands the bytes in local
arena slots and commits them, so the Lookup that follows finds them in RAM: a remote hit becomes a local hit,
and a prefix Lookup consults every peer with one call, never one RPC per key.

Faults are misses: a call that fails or runs past `timeout_s` counts (errors / timeouts) and its keys stay
missing; the peer is then skipped for `backoff_s`, so a dead node costs one timeout, not one per Lookup, until
its etcd lease expires and it leaves the member set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from kvstore.errors import KVStoreError
from kvstore.peer.counters import PeerCounters
from kvstore.peer.membership import Member
from kvstore.peer.placement import rank
from kvstore.peer.plane import DataPlane, PeerCallError, PeerTimeout

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

__all__ = ["RemoteTier"]

log = logging.getLogger(__name__)


class RemoteTier:
    def __init__(self, engine: Engine, plane: DataPlane, members: Callable[[], dict[str, Member]], me: str, *, copies: int,
                 timeout_s: float, max_keys: int, counters: PeerCounters, backoff_s: float = 1.0) -> None:
        self._engine = engine
        self._plane = plane
        self._members = members  # () -> dict[node_id, Member], this node included
        self._me = me
        self._copies = copies
        self._timeout = timeout_s
        self._max_keys = max_keys
        self._counters = counters
        self._backoff = backoff_s
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-peer-fetch")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def route(self, namespace: str, keys: list[bytes], members: dict[str, Member]) -> dict[str, list[bytes]]:
        """Peer node id -> the keys to ask it for (each key once; keys this node owns alone are skipped)."""
        ids = list(members)
        routes: dict[str, list[bytes]] = {}
        for key in keys:
            ranked = rank(namespace, key, ids)
            target = ranked[0]
            if target == self._me:
                if self._copies < 2 or len(ranked) < 2:
                    continue
                target = ranked[1]
            routes.setdefault(target, []).append(key)
        return routes

    def fill(self, namespace: str, keys: list[bytes]) -> int:
        """Fetch the keys missing here from their owners into the local arena; returns blocks stored."""
        members = self._members()
        if len(members) < 2 or not keys:
            return 0
        try:
            present = self._engine.exists(namespace, keys)
        except KVStoreError:
            return 0  # unknown namespace, bad keys: the Lookup itself reports it
        missing = list(dict.fromkeys(k for k, p in zip(keys, present) if not p))
        if not missing:
            return 0
        calls: list[tuple[Member, list[bytes]]] = []
        now = time.monotonic()
        for node, ks in self.route(namespace, missing, members).items():
            if self._down_until.get(node, 0.0) > now:
                self._counters.add("fetch_misses", len(ks))
                continue
            for i in range(0, len(ks), self._max_keys):
                calls.append((members[node], ks[i: i + self._max_keys]))
        if not calls:
            return 0
        if len(calls) == 1:
            return self._fetch_one(calls[0][0], namespace, calls[0][1])
        futures = {self._pool.submit(self._fetch_one, m, namespace, ks): (m, ks) for m, ks in calls}
        done, late = wait(futures, timeout=self._timeout + 0.5)
        for f in late:  # still running past the bound: this Lookup does not wait for it (it may still land)
            m, ks = futures[f]
            self._counters.add("timeouts")
            log.warning("fetch of %d keys from %s ran past %.2fs", len(ks), m.node_id, self._timeout)
        return sum(f.result() for f in done)

    def _fetch_one(self, member: Member, namespace: str, keys: list[bytes]) -> int:
        """One batched call; failures become misses (counted) and put the peer in a short backoff."""
        self._counters.add("fetch_calls")
        self._counters.add("fetch_keys", len(keys))
        try:
            stored = self._plane.fetch(member, namespace, keys)
        except PeerCallError as exc:
            self._counters.add("timeouts" if isinstance(exc, PeerTimeout) else "errors")
            self._counters.add("fetch_misses", len(keys))
            with self._lock:
                self._down_until[member.node_id] = time.monotonic() + self._backoff
            log.warning("peer fetch of %d keys failed, counted as misses: %s", len(keys), exc)
            return 0
        except Exception:  # a bug in one call must not fail the Lookup: the keys are misses
            log.exception("peer fetch from %s failed", member.node_id)
            self._counters.add("errors")
            self._counters.add("fetch_misses", len(keys))
            return 0
        with self._lock:
            self._down_until.pop(member.node_id, None)
        self._counters.add("fetched_blocks", stored)
        self._counters.add("fetch_misses", len(keys) - stored)
        return stored
