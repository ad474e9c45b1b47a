"""Claims: a scheduler that misses says it is computing those blocks now; another one that misses them
meanwhile waits for that save instead of computing them too (the daemon's side: kvstore/engine/claims.py).

Why: vLLM shares a prefix that is still being computed between requests on one server (its prefix cache
holds a block from its allocation), but two servers behind a load balancer that get prompts with one new
prefix at once (sessions of one agent starting together, sub-agents forked at once) both computed it; the
peer-tier benchmark's configuration (d) computed a shared system prompt twice this way.

    scheduler (get_num_new_matched_tokens)      the lookup's hit stops at key n: Claim keys[n:] for this
                                                process; the leading keys the answer says are HELD or PENDING
                                                extend the hit, loaded asynchronously (`pending_keys`)
    worker (the load of such a request)         wait until every key of the job is held on this node or at its
                                                owner (Exists, cluster-wide, every 10-50 ms), at most claim_ms; load
                                                the leading keys that came, and report the rest failed: vLLM
                                                recomputes from there, as for any failed load (`wait_ready`)

A claim costs one round trip on a miss only (the request computes anyway). Its time bounds what a waiter can
lose: a claimant that was preempted, aborted or died leaves a claim that runs out after claim_ms, and a waiter
then computes what did not come.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence

from kvstore_connector.plan import LoadJob
from kvstore_connector.stats import ConnectorCounters
from kvstore.engine.claims import CLAIMED

__all__ = ["new_claimant", "loadable_run", "wait_ready", "await_claimed", "POLL_S", "MAX_POLL_S"]

# Between two checks of a waiting load: 10 ms at first, then 1.5x longer each time up to 50 ms. Each check is an
# Exists at the node and a probe at the keys' owners; over a claim of seconds, checks every 10 ms would take CPU
# from the very prefill being waited for wherever the servers share cores, and 50 ms is still a fraction of any
# prefill worth waiting for.
POLL_S, MAX_POLL_S, POLL_GROWTH = 0.01, 0.05, 1.5


def new_claimant() -> bytes:
    """This scheduler process's id in claims (its claims renew, never block, its own later lookups)."""
    return os.urandom(16)


def loadable_run(states: Sequence[int]) -> int:
    """The leading keys that will be loadable (HELD, or PENDING: another claimant saves them); the first one the
    caller must compute (CLAIMED) ends the run."""
    n = 0
    for s in states:
        if s == CLAIMED:
            break
        n += 1
    return n


def wait_ready(held: Callable[[], Sequence[bool]], deadline: float, poll_s: float = POLL_S,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
               max_poll_s: float = MAX_POLL_S) -> int:
    """How many leading keys are held, checked with `held()` until all are or `deadline` (clock time) passes;
    the pause between checks grows from `poll_s` to `max_poll_s`, the last check is at the deadline."""
    pause = poll_s
    while True:
        got = list(held())
        ready = next((i for i, h in enumerate(got) if not h), len(got))
        if ready == len(got) or clock() >= deadline:
            return ready
        sleep(min(pause, max(0.0, deadline - clock())))
        pause = min(max_poll_s, pause * POLL_GROWTH)


def await_claimed(job: LoadJob, held: Callable[[], Sequence[bool]], counters: ConnectorCounters,
                  clock: Callable[[], float] = time.monotonic) -> tuple[LoadJob, list[int]]:
    """A load with keys another scheduler is saving (`job.wait_s` > 0): wait for them (`held()`: per key of the
    job, held on this node or at its owner), then (the job of the leading keys that came, the vLLM blocks of
    the others: failed, so vLLM computes them). Each group's block list holds the same number per key."""
    t0 = clock()
    ready = wait_ready(held, t0 + job.wait_s, clock=clock)
    n = len(job.keys)
    counters.add(claim_waits=1, claim_waits_served=int(ready == n), claim_wait_missed_keys=n - ready,
                 claim_wait_seconds=clock() - t0)
    if ready == n:
        return job, []
    per = [len(b) // n for b in job.block_ids]
    late = [x for b, g in zip(job.block_ids, per) for x in b[ready * g:] if x >= 0]
    return dataclasses.replace(job, keys=job.keys[:ready], block_ids=[b[:ready * g] for b, g in
                                                                     zip(job.block_ids, per)], wait_s=0.0), late
