"""Reads from peers: on a local RAM + disk miss, ask each missing block's owner, one batched call per peer.

Both entry points run at the start of an engine Lookup (no engine lock held), find the keys this node does not
hold and route each to its owner by rendezvous hashing (or, under `owner+1`, to the replica when this node is
the owner); every peer's batch goes out in parallel, so a prefix Lookup consults every peer with one call,
never one RPC per key.

    prefetch(ns, keys)  a Lookup WITHOUT lease (a scheduler asking how much of a prompt is cached): one
                        metadata-only probe per peer says which keys it holds; their fetch starts in the
                        background and the Lookup answers at once, counting them as present (tier "peer"), like
                        the disk tier's promotions. The scheduler never waits for remote bytes.
    fill(ns, keys)      a Lookup WITH lease (a load): waits for the prefetches of these keys still in flight,
                        then fetches whatever is still missing. The data plane lands the bytes in local arena
                        slots and commits them, so the Lookup that follows finds them in RAM.

Whom to ask (placement.read_order): the block's owner under the current member set, then, during the
hand-off window after a membership change, its owners under the earlier sets (`previous`). Each is a round:
the keys the first round's peers did not hold go, batched per peer again, to their next candidate
(`fallback_keys`, `fallback_hits`). Outside a hand-off window there is one round, as before: a miss at the
owner costs nothing more. So a node that joined, and owns blocks it has not yet been handed, still serves
them (from where they were); a node that left gracefully handed its blocks over first.

In-flight prefetches are bounded (`max_inflight_keys`); beyond it a probe is skipped and its keys count as
misses (`prefetch_skipped`), so a burst of scheduler lookups cannot queue unbounded transfers.

Faults are misses: a call that fails or runs past `timeout_s` counts (errors / timeouts) and its keys stay
missing; the peer is then skipped for `backoff_s`, so a dead node costs one timeout, not one per Lookup, until
its etcd lease expires and it leaves the member set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, TypeVar

from kvstore.engine.claims import CLAIMED, PENDING
from kvstore.engine.results import Filled
from kvstore.errors import KVStoreError
from kvstore.peer.counters import PeerCounters
from kvstore.peer.membership import Member
from kvstore.peer.placement import read_orders
from kvstore.peer.plane import DataPlane, PeerCallError, PeerError, PeerTimeout

if TYPE_CHECKING:
    from kvstore.engine.engine import Engine

R = TypeVar("R")

__all__ = ["RemoteTier"]

MAX_UNREAD = 1 << 16  # fetched blocks remembered until a load reads them (oldest forgotten first)

log = logging.getLogger(__name__)


class RemoteTier:
    def __init__(self, engine: Engine, plane: DataPlane, members: Callable[[], dict[str, Member]], me: str, *, copies: int,
                 timeout_s: float, max_keys: int, counters: PeerCounters, backoff_s: float = 1.0,
                 previous: Callable[[], list[frozenset[str]]] = lambda: [],
                 placement: Callable[[], frozenset[str]] | None = None,
                 fetched: Callable[[str, list[bytes]], None] = lambda ns, keys: None) -> None:
        self._engine = engine
        self._plane = plane
        self._members = members  # () -> dict[node_id, Member], this node included
        self._previous = previous  # () -> the member sets of the hand-off window, newest first
        self._placement = placement  # () -> the members that own blocks (not leaving); None: every member
        self._fetched = fetched    # blocks fetched here and since read (guests.py lets go of those not owned)
        self._unread: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # fetched, not yet read by a load
        self._me = me
        self._copies = copies
        self._timeout = timeout_s
        self._max_keys = max_keys
        self._counters = counters
        self._backoff = backoff_s
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-peer-fetch")
        self._probes = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-peer-probe")  # never queued
        self._inflight: dict[tuple[str, bytes], Future[int]] = {}   # prefetches not finished, by (ns, key)
        self.max_inflight_keys = 8 * max_keys

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)

    def orders(self, namespace: str, keys: list[bytes], members: dict[str, Member]) -> dict[bytes, list[str]]:
        """Per key (each once), the peers to ask in turn (placement.read_order); keys no peer can hold (this
        node owns them alone, outside a hand-off window) are left out."""
        keys = list(dict.fromkeys(keys))
        reachable = frozenset(members)
        owning = self._placement() if self._placement is not None else reachable
        orders = read_orders(namespace, keys, owning, self._previous(), self._copies, self._me, reachable)
        return {k: o for k, o in zip(keys, orders) if o}

    def route(self, namespace: str, keys: list[bytes], members: dict[str, Member]) -> dict[str, list[bytes]]:
        """Peer node id -> the keys to ask it for first (each key once; keys this node owns alone are skipped)."""
        routes: dict[str, list[bytes]] = {}
        for key, order in self.orders(namespace, keys, members).items():
            routes.setdefault(order[0], []).append(key)
        return routes

    def _missing(self, namespace: str, keys: list[bytes]) -> list[bytes] | None:
        """Keys not held here, each once; None when the engine refuses the request (the Lookup reports it)."""
        try:
            present = self._engine.exists(namespace, keys)
        except KVStoreError:
            return None
        return list(dict.fromkeys(k for k, p in zip(keys, present) if not p))

    def _calls(self, routes: dict[str, list[bytes]], members: dict[str, Member]) -> list[tuple[Member, list[bytes]]]:
        """Per-peer batches of at most max_keys; keys of peers in backoff are misses (counted)."""
        calls: list[tuple[Member, list[bytes]]] = []
        now = time.monotonic()
        for node, ks in routes.items():
            if self._down_until.get(node, 0.0) > now or node not in members:
                self._counters.add("fetch_misses", len(ks))
                continue
            for i in range(0, len(ks), self._max_keys):
                calls.append((members[node], ks[i: i + self._max_keys]))
        return calls

    @staticmethod
    def _round(orders: dict[bytes, list[str]], keys: list[bytes], r: int) -> dict[str, list[bytes]]:
        """Round r's routes: each key to its r-th candidate (keys with fewer candidates drop out)."""
        routes: dict[str, list[bytes]] = {}
        for key in keys:
            order = orders.get(key)
            if order is not None and len(order) > r:
                routes.setdefault(order[r], []).append(key)
        return routes

    def _run_all(self, fn: Callable[[Member, list[bytes]], R], calls: list[tuple[Member, list[bytes]]],
                 pool: ThreadPoolExecutor) -> list[tuple[Member, list[bytes], R]]:
        """fn over every call, in parallel; calls still running past the bound are left out (they may land)."""
        if len(calls) == 1:
            m, ks = calls[0]
            return [(m, ks, fn(m, ks))]
        futures = {pool.submit(fn, m, ks): (m, ks) for m, ks in calls}
        done, late = wait(futures, timeout=self._timeout + 0.5)
        for f in late:
            m, ks = futures[f]
            self._counters.add("timeouts")
            log.warning("call for %d keys to %s ran past %.2fs", len(ks), m.node_id, self._timeout)
        return [(*futures[f], f.result()) for f in done]

    def prefetch(self, namespace: str, keys: list[bytes], prefix: bool = False) -> list[bool]:
        """Per key: a peer holds it and it is being fetched here (see the module docstring). With `prefix`,
        only keys before the first one that no node holds are fetched: a prefix Lookup cannot use the rest."""
        members = self._members()
        if len(members) < 2 or not keys:
            return [False] * len(keys)
        try:
            local = self._engine.exists(namespace, keys)
        except KVStoreError:
            return [False] * len(keys)  # unknown namespace, bad keys: the Lookup itself reports it
        missing = list(dict.fromkeys(k for k, p in zip(keys, local) if not p))
        with self._lock:
            held = {k for k in missing if (namespace, k) in self._inflight}
            room = self.max_inflight_keys - len(self._inflight)
        ask = [k for k in missing if k not in held]
        if len(ask) > room:
            self._counters.add("prefetch_skipped", len(ask))
            ask = []
        found = self.locate(namespace, ask, members) if ask else []
        usable = _usable(keys, local, held | {k for _, ks in found for k in ks}, prefix)
        for member, ks in found:
            ks = [k for k in ks if k in usable]
            if ks:
                self._counters.add("prefetch_keys", len(ks))
                self._track(namespace, ks, self._pool.submit(self._fetch_one, member, namespace, ks))
                held.update(ks)
        return [k in held for k in keys]

    def claim(self, namespace: str, keys: list[bytes], claimant: bytes, ttl_ms: int) -> dict[bytes, int]:
        """A scheduler's Claim (kvstore/engine/claims.py) at each key's owner, one claiming probe per peer in
        parallel: key -> HELD or PENDING there (keys the owner now holds the claim for, and keys of owners
        that failed, in backoff or are this node, are left out: this node's own table decides them). Only the
        owner is asked, never a previous owner: a claim must live where every node's Claim looks."""
        members = self._members()
        if len(members) < 2 or not keys:
            return {}
        now = time.monotonic()
        calls = [(members[node], ks[i: i + self._max_keys]) for node, ks in self.route(namespace, keys, members).items()
                 if node in members and self._down_until.get(node, 0.0) <= now
                 for i in range(0, len(ks), self._max_keys)]
        out: dict[bytes, int] = {}
        for _member, ks, states in self._run_all(
                lambda m, b: self._claim_one(m, namespace, b, claimant, ttl_ms), calls, self._probes):
            out.update((k, x) for k, x in zip(ks, states) if x != CLAIMED)
        return out

    def _claim_one(self, member: Member, namespace: str, keys: list[bytes], claimant: bytes,
                   ttl_ms: int) -> list[int]:
        """One claiming probe; a failure claims nothing there (counted): the caller computes. The peer is not put in
        backoff: a node of an older version refuses the claim flag but serves fetches (a rolling upgrade), and a
        dead one is put there by the Lookup's own probe, which just asked the same owners."""
        self._counters.add("claim_calls")
        try:
            states = self._plane.claim(member, namespace, keys, claimant, ttl_ms)
        except PeerCallError as exc:
            self._counters.add("timeouts" if isinstance(exc, PeerTimeout) else "errors")
            log.warning("peer claim of %d keys at %s failed (they are computed here): %s", len(keys),
                        member.node_id, exc)
            return [CLAIMED] * len(keys)
        self._counters.add("claim_pending_keys", sum(1 for x in states if x == PENDING))
        return states

    def locate(self, namespace: str, keys: list[bytes],
               members: dict[str, Member] | None = None) -> list[tuple[Member, list[bytes]]]:
        """Which peer holds which of `keys`, by metadata-only probes: the owners first, then (hand-off window)
        the previous owners of the keys the owners lacked. No bytes move."""
        members = self._members() if members is None else members
        found: list[tuple[Member, list[bytes]]] = []

        def probe_round(calls: list[tuple[Member, list[bytes]]]) -> set[bytes]:
            hit: set[bytes] = set()
            for member, ks, mask in self._probe_all(namespace, calls):
                got = [k for k, p in zip(ks, mask) if p]
                if got:
                    found.append((member, got))
                    hit.update(got)
            return hit

        self._rounds(self.orders(namespace, keys, members), members, probe_round)
        return found

    def _rounds(self, orders: dict[bytes, list[str]], members: dict[str, Member],
                run: Callable[[list[tuple[Member, list[bytes]]]], set[bytes]]) -> None:
        """Ask each key's candidates in turn (read_orders): round r sends every key still unanswered to its r-th
        candidate, batched per peer; `run(calls)` makes a round's calls and answers which keys it found.
        Rounds past the first are the hand-off window's fallbacks (counted)."""
        left = list(orders)
        r = 0
        while left:
            calls = self._calls(self._round(orders, left, r), members)
            if not calls:
                return
            if r:
                self._counters.add("fallback_keys", sum(len(ks) for _, ks in calls))
            hit = run(calls)
            if r:
                self._counters.add("fallback_hits", len(hit))
            left = [k for k in left if k not in hit]
            r += 1

    def _track(self, namespace: str, keys: list[bytes], fut: Future[int]) -> None:
        with self._lock:
            for k in keys:
                self._inflight[(namespace, k)] = fut

        def untrack(f: Future[int]) -> None:
            with self._lock:
                for k in keys:
                    if self._inflight.get((namespace, k)) is f:
                        del self._inflight[(namespace, k)]
        fut.add_done_callback(untrack)

    def fill(self, namespace: str, keys: list[bytes]) -> Filled:
        """Wait for this Lookup's prefetches in flight, then fetch the keys still missing here, from their owners
        and then (hand-off window) their previous owners; the blocks stored by this call, and the keys found here
        (held before, or fetched now: either may be let go before the Lookup's lease, Engine.lookup asks again).

        A key that every candidate missed while earlier owners were asked is asked of its owner once more: a
        previous owner lets its copy go only once the owner confirmed holding it, so a read that reached the
        owner just before the hand-off landed and the previous owner just after finds it there now."""
        members = self._members()
        if len(members) < 2 or not keys:
            return Filled(0)
        with self._lock:
            pending = {f for f in (self._inflight.get((namespace, k)) for k in keys) if f is not None}
        if pending:
            wait(pending, timeout=self._timeout + 0.5)
        missing = self._missing(namespace, keys)
        if missing is None:
            return Filled(0)
        if not missing:
            return Filled(0, frozenset(keys))
        stored = 0
        found: set[bytes] = set()

        def fetch_round(calls: list[tuple[Member, list[bytes]]]) -> set[bytes]:
            nonlocal stored
            got = sum(int(n) for _, _, n in self._run_all(lambda m, b: self._fetch_one(m, namespace, b), calls,
                                                         self._pool))
            stored += got
            asked = [k for _, ks in calls for k in ks]
            if got == len(asked):  # every key asked (each once) was stored by these calls: no need to look again
                hit = set(asked)
            else:
                missing_now = self._missing(namespace, asked)
                still = set(asked if missing_now is None else missing_now)
                hit = {k for k in asked if k not in still}
            found.update(hit)
            return hit

        orders = self.orders(namespace, missing, members)
        self._rounds(orders, members, fetch_round)
        again = [k for k, order in orders.items() if len(order) > 1 and k not in found]
        if again:
            calls = self._calls(self._round(orders, again, 0), members)
            if calls:
                self._counters.add("fallback_keys", len(again))
                self._counters.add("fallback_hits", len(fetch_round(calls)))
        return Filled(stored, frozenset(keys).difference(missing) | found)

    def _probe_all(self, namespace: str,
                   calls: list[tuple[Member, list[bytes]]]) -> list[tuple[Member, list[bytes], list[bool]]]:
        """Every probe of a round: pipelined from this thread where the plane can, else one thread each."""
        if not self._plane.pipelines_probes or len(calls) < 2:
            return self._run_all(lambda m, b: self._probe_one(m, namespace, b), calls, self._probes)
        self._counters.add("probe_calls", len(calls))
        try:
            answers = self._plane.probe_many([(m, namespace, ks) for m, ks in calls])
        except Exception:
            log.exception("peer probes failed")
            answers = [PeerError("probe_many failed")] * len(calls)
        return [(m, ks, self._probed(m, ks, a)) for (m, ks), a in zip(calls, answers)]

    def _probe_one(self, member: Member, namespace: str, keys: list[bytes]) -> list[bool]:
        """One metadata-only call; a failure is 'none of them' (counted) and puts the peer in backoff."""
        self._counters.add("probe_calls")
        try:
            answer: list[bool] | PeerCallError = self._plane.probe(member, namespace, keys)
        except PeerCallError as exc:
            answer = exc
        except Exception:
            log.exception("peer probe of %s failed", member.node_id)
            self._counters.add("errors")
            self._counters.add("fetch_misses", len(keys))
            return [False] * len(keys)
        return self._probed(member, keys, answer)

    def _probed(self, member: Member, keys: list[bytes], answer: list[bool] | PeerCallError) -> list[bool]:
        """A probe's answer; a failure is 'none of them' (counted) and puts the peer in backoff."""
        if not isinstance(answer, PeerCallError):
            return answer
        self._counters.add("timeouts" if isinstance(answer, PeerTimeout) else "errors")
        with self._lock:
            self._down_until[member.node_id] = time.monotonic() + self._backoff
        log.warning("peer probe of %d keys failed, counted as misses: %s", len(keys), answer)
        self._counters.add("fetch_misses", len(keys))
        return [False] * len(keys)

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
        if stored:
            with self._lock:
                for k in keys:
                    self._unread[(namespace, k)] = None
                while len(self._unread) > MAX_UNREAD:
                    self._unread.popitem(last=False)
        return stored

    def loaded(self, namespace: str, keys: list[bytes]) -> None:
        """A leased Lookup of `keys` is done: the blocks fetched for it are leased by it now, so marking them
        guests (first to go) cannot take them from under this load; before it, the next batch landing for the
        same load could have. Blocks a scheduler's probe fetched and no load read stay ordinary entries."""
        with self._lock:
            read = [k for k in keys if (namespace, k) in self._unread]
            for k in read:
                del self._unread[(namespace, k)]
        if read:
            self._fetched(namespace, read)


def _usable(keys: list[bytes], local: list[bool], remote: set[bytes], prefix: bool) -> set[bytes]:
    """The keys worth fetching: all that peers hold, or with `prefix` those before the first key nobody holds."""
    if not prefix:
        return remote
    out: set[bytes] = set()
    for k, here in zip(keys, local):
        if not here and k not in remote:
            break
        if not here:
            out.add(k)
    return out
