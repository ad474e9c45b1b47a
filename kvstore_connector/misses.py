"""Why a request missed: one cause per connector request, for the first block the store did not serve.

The scheduler side knows some causes itself, at no cost:

    store_down      the link is down (daemon stopped or unreachable): the lookup was not made or failed UNAVAILABLE
    lookup_failed   the lookup call failed otherwise (a timeout, a refused registration, any other store error)
    stream_mode     no lookup at all: this process cannot map the daemon's arena, so no worker could load
    load_failed     the lookup served every usable key but the worker's load of them failed (a key evicted or
                    deleted since the lookup, a lease lost, the store down at load time)

The others only the daemon knows (kvstore/engine/misses.py: never_stored, evicted, disk_reclaimed, deleted,
cleared, other_namespace). Asking it costs a round trip, which must not delay vLLM's scheduler, so the scheduler
hands the first missing key (and the shard namespaces that may lack it, in shard order) to `MissExplainer`: a
bounded queue read by one background thread, which asks `Client.explain` once per namespace for every key queued
since its last round (a batch) and counts the cause of the first namespace that does not hold the key. A miss
it cannot explain is counted ``unexplained``: the queue was full, the explain call failed or the client has no
``explain``, the daemon named no cause we know, or the key is present again by the time it is asked (stored since
the lookup, or present but not served: a failed promotion). So every request that missed counts exactly one
``miss_<cause>`` counter, and their sum is the number of requests the store did not fully serve.

`flush` waits until every queued miss is counted (tests, shutdown); the thread starts with the first miss and
ends after ``idle_s`` without one.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore_connector.background import Background
from kvstore_connector.counter_names import (CONNECTOR_CAUSES, DAEMON_CAUSES, LOAD_FAILED, LOOKUP_FAILED, MISS_CAUSES,
                                     STORE_DOWN, STREAM_MODE, UNEXPLAINED)
from kvstore_connector.stats import ConnectorCounters
from kvstore.vocab import Tier

if TYPE_CHECKING:
    from kvstore_connector.link import StoreLink

__all__ = ["MissExplainer", "MissTarget", "MissRecord", "DAEMON_CAUSES", "CONNECTOR_CAUSES", "MISS_CAUSES",
           "STORE_DOWN", "LOOKUP_FAILED", "STREAM_MODE", "LOAD_FAILED", "UNEXPLAINED"]

log = logging.getLogger(__name__)


_NONE = int(Tier.NONE)


@dataclass(frozen=True)
class MissTarget:
    """The first key a lookup did not get, and the shard namespaces that may lack it (in shard order: the first
    one the daemon says does not hold it is blamed)."""

    namespaces: tuple[str, ...]
    key: bytes


@dataclass(frozen=True)
class MissRecord:
    """One request's counted miss (`MissExplainer.recent`): the cause, and for a daemon cause what it said."""

    req_id: str
    cause: str
    namespace: str = ""                     # the shard namespace blamed (daemon causes)
    age_s: float = 0.0                      # seconds since the key left (evicted, deleted, ...)
    policy: str = ""                        # the eviction policy, for "evicted"
    other_namespaces: tuple[str, ...] = ()  # namespaces holding the key now, when absent here


class MissExplainer:
    """Counts one miss cause per request; asks the daemon for the causes only it knows, off the caller's thread."""

    def __init__(self, link: StoreLink, counters: ConnectorCounters, *, capacity: int = 1024,
                 recent: int = 256, idle_s: float = 30.0) -> None:
        """``capacity``: misses waiting for the daemon at most (one more is counted unexplained at once);
        ``recent``: how many counted misses `recent` keeps; ``idle_s``: the thread ends after this long without
        a miss (the next one starts it again), so an idle or forgotten scheduler side holds no thread."""
        self.link = link
        self.counters = counters
        self.recent: deque[MissRecord] = deque(maxlen=recent)
        self._recent_lock = threading.Lock()
        self._misses: Background[tuple[str, MissTarget]] = Background("kvstore-explain", self._run,
                                                                      capacity=capacity, idle_s=idle_s)
        self._no_explain_logged = False

    # -- the scheduler's thread ------------------------------------------------------------------------
    def count(self, req_id: str, cause: str) -> None:
        """A cause the connector knows itself: counted now."""
        self._count([MissRecord(req_id, cause)])

    def submit(self, req_id: str, target: MissTarget) -> None:
        """Queue a miss for the daemon to explain; never blocks (a full queue counts it unexplained)."""
        if not self._misses.submit((req_id, target)):
            self.count(req_id, UNEXPLAINED)

    @property
    def capacity(self) -> int:
        return self._misses.capacity

    @capacity.setter
    def capacity(self, n: int) -> None:
        self._misses.capacity = n

    @property
    def running(self) -> bool:
        """Whether the explain thread is alive (it ends when idle)."""
        return self._misses.running

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued miss is counted; False if ``timeout_s`` passed first."""
        return self._misses.flush(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Count what is queued (flush), then stop the thread."""
        self._misses.close(timeout_s)

    # -- the background thread -------------------------------------------------------------------------
    def _run(self, batch: list[tuple[str, MissTarget]]) -> None:
        try:
            records = self._explain(batch)
        except Exception:  # noqa: BLE001 - the thread must live on; these misses stay unexplained
            log.exception("kvstore connector: explaining %d misses failed", len(batch))
            records = [MissRecord(rid, UNEXPLAINED) for rid, _ in batch]
        self._count(records)

    def _explain(self, batch: Sequence[tuple[str, MissTarget]]) -> list[MissRecord]:
        """One explain call per namespace for every key of the batch it may lack; one record per miss."""
        wanted: dict[str, list[bytes]] = {}
        for _, target in batch:
            for ns in target.namespaces:
                keys = wanted.setdefault(ns, [])
                if target.key not in keys:
                    keys.append(target.key)
        answers: dict[tuple[str, bytes], Any] = {}
        for ns, keys in wanted.items():
            got = self._ask(ns, keys)
            if got is not None:
                answers.update(((ns, k), e) for k, e in zip(keys, got))
        return [self._blame(rid, target, answers) for rid, target in batch]

    def _ask(self, ns: str, keys: list[bytes]) -> list[Any] | None:
        """The daemon's explanation of each key in ``ns``; None when it cannot be asked (store down, a failed
        call, a client without explain)."""
        c = self.link.client
        if c is None:
            return None
        if not callable(getattr(c, "explain", None)):
            if not self._no_explain_logged:
                self._no_explain_logged = True
                log.info("kvstore connector: this kvstore client has no explain(); misses the daemon would explain "
                         "are counted as miss_unexplained")
            return None
        got = self.link.call(ns, lambda cl: cl.explain(ns, keys))
        return list(got) if got is not None and len(got) == len(keys) else None

    @staticmethod
    def _blame(req_id: str, target: MissTarget, answers: dict[tuple[str, bytes], Any]) -> MissRecord:
        """The cause in the first namespace (in shard order) that does not hold the key; unexplained when one
        before it could not be asked, or every namespace holds it now."""
        for ns in target.namespaces:
            e = answers.get((ns, target.key))
            if e is None:
                return MissRecord(req_id, UNEXPLAINED, ns)
            if int(getattr(e, "tier", _NONE)) != _NONE:
                continue
            cause = str(getattr(e, "cause", ""))
            if cause not in DAEMON_CAUSES:
                return MissRecord(req_id, UNEXPLAINED, ns)
            return MissRecord(req_id, cause, ns, float(getattr(e, "age_s", 0.0)), str(getattr(e, "policy", "")),
                              tuple(getattr(e, "other_namespaces", ()) or ()))
        return MissRecord(req_id, UNEXPLAINED)

    def _count(self, records: Sequence[MissRecord]) -> None:
        by_cause = Counter("miss_" + r.cause for r in records)
        if by_cause:
            self.counters.add(**by_cause)
        with self._recent_lock:  # the scheduler's thread and the explain thread both count
            self.recent.extend(records)
