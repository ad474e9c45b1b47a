"""Counters the connector keeps for vLLM's stats logging and for tests: hit tokens, bytes, failures.

Plain numbers behind a lock (the worker's load and commit threads update them). vLLM pulls them with
get_kv_connector_stats(), which takes and resets the interval's values; `totals` keeps running sums.

Misses (kvstore_connector/misses.py): every request the store did not fully serve counts one ``miss_<cause>``, the cause
of the first block it did not serve; `miss_summary` adds their sum (``miss_causes``) to a reduced interval.
Hints (kvstore_connector/hints.py): ``hint_<outcome>`` per key and shard namespace, and ``hint_malformed``,
``hint_failed``, ``hint_dropped``, ``hint_empty``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from kvstore_connector.counter_names import HINT_COUNTERS, MISS_CAUSES

__all__ = ["ConnectorCounters", "COUNTER_NAMES", "MISS_COUNTERS", "miss_summary", "timed"]

#: one counter per miss cause: requests whose first block not served had that cause
MISS_COUNTERS = tuple("miss_" + c for c in MISS_CAUSES)

COUNTER_NAMES = (
    "lookup_tokens", "hit_tokens", "load_requests", "save_keys",          # scheduler side
    "load_sync_requests",     # of load_requests, those loaded in the step that schedules them
    "load_sync_fetch_requests",  # of those, the ones that read blocks from disk or peers (sync_fetch_bytes)
    "lookup_skipped_stream",  # lookups answered 0: the arena cannot be mapped, so no worker could load
    "load_rollback_keys",     # stored blocks to save again because their load failed
    "lookup_window_short_keys",  # hybrid models: stored blocks a hit lost because a windowed group lacked its window
    # claims (kvstore_connector/claims.py): keys claimed on a miss; keys another server was computing (waited for);
    # waiting loads, those whose keys all came, the keys that did not (recomputed), and the seconds waited
    "claimed_keys", "claim_pending_keys", "claim_waits", "claim_waits_served", "claim_wait_missed_keys",
    "claim_wait_seconds",
    # where the looked-up prompt tokens would come from: vLLM's own prefix cache, then the store's tiers
    "served_tokens_vllm", "served_tokens_ram", "served_tokens_disk", "served_tokens_peer",
    "tail_hit_tokens",        # of the served tokens, those of partial last blocks (kvstore_connector/tails.py)
    "tail_saves",             # partial last blocks the scheduler side asked the worker to store
    "loaded_blocks", "loaded_bytes", "load_failed_blocks", "load_seconds",  # worker side
    "saved_blocks", "saved_bytes", "save_skipped_blocks", "save_failures", "save_seconds",
    # wall time vLLM's threads spent inside the connector's hooks (`timed`): its direct cost on the step's path
    "scheduler_hook_seconds", "worker_hook_seconds",
    "connect_failures",       # connects to the daemon that failed (none answers at the address: kvstore_connector/link.py)
    # vLLM identities of saved keys sent to the daemon for its vLLM-format KV events (kvstore_connector/origins.py)
    "annotated_keys", "annotate_failures",
) + MISS_COUNTERS + HINT_COUNTERS  # hints (kvstore_connector/hints.py): outcomes per key and shard, malformed, ...
_KNOWN = frozenset(COUNTER_NAMES)  # `add` checks every name it is given, now on every timed hook call too


def miss_summary(data: Mapping[str, float]) -> dict[str, int | float]:
    """``miss_causes``: the requests of an interval the store did not fully serve (the sum of the ``miss_*``
    counters, one per such request), for KVStoreStats.reduce; empty when none missed."""
    total = sum(data.get(name, 0) for name in MISS_COUNTERS)
    return {"miss_causes": total} if total else {}


class ConnectorCounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval: dict[str, float] = {}
        self.totals: dict[str, float] = {}

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                if k not in _KNOWN:
                    raise KeyError(f"unknown connector counter {k!r}")
                self._interval[k] = self._interval.get(k, 0) + v
                self.totals[k] = self.totals.get(k, 0) + v

    def take(self) -> dict[str, float]:
        """This interval's values (and reset them)."""
        with self._lock:
            out, self._interval = self._interval, {}
            return out


class _Counted(Protocol):
    counters: ConnectorCounters


_F = TypeVar("_F", bound=Callable[..., Any])


def timed(counter: str) -> Callable[[_F], _F]:
    """Adds a hook's wall time to `counter` of its instance's `counters`, whatever it returns or raises.

    Why: what a connector costs a request that gains nothing from it (nothing stored hits) is the time vLLM's
    scheduler and worker threads spend inside its hooks, since vLLM waits for each. Measured around each call,
    that time is exact on a machine whose throughput from run to run moves far more than it (bench.serve's
    no-reuse rounds: ~1 % here against +-20 % from one round to the next); two clock reads and a locked add
    cost ~1.5 us a call."""
    if counter not in _KNOWN:
        raise KeyError(f"unknown connector counter {counter!r}")

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def hook(self: _Counted, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.counters.add(**{counter: time.perf_counter() - t0})
        return hook  # type: ignore[return-value]
    return wrap
