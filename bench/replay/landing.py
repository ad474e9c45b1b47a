"""The order the daemon's promotions landed in, read from its KV event stream, for a replay under S3-FIFO.

Why: a probe that finds several blocks only on disk starts one promotion each; the daemon's two promoter
threads read them concurrently, and each block joins the RAM policy (`on_insert`) when its read lands, in
whichever order the threads finish. LRU does not care (the get re-touches the whole prefix in chain order),
but S3-FIFO's queues are FIFOs: the landing order decides which of those blocks is evicted first, much later.
It is the one input of the model that is a thread race, not a rule, so the replay records it instead of
guessing: the engine publishes a `moved` event (disk -> RAM) under its lock right after each insert, so the
event stream lists the promoted keys in exactly the policy's order. The simulator then takes each probe's
landings from this list (sim.CacheSim, `landed`); everything else it still derives from the trace.

`replay_observed` is replayer.replay with a Subscribe stream open for the whole run (its `watch` hook). A
sentinel block put in a second namespace after the last request marks the end of the stream (events reach a
subscriber in publish order), so no landing is missed; a gap (events dropped for a slow reader) fails the run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from bench.replay.replayer import NAMESPACE, ReplayResult, replay
from bench.replay.tiers import StoreSpec
from bench.replay.trace import Convention, Request
from kvstore.client import Client
from kvstore.testing import wait_until

__all__ = ["LandingLog", "replay_observed"]

SENTINEL_NS = "replay-landing-end"
_SENTINEL_KEY = b"landing-end"
_BUFFER = 1 << 20  # the daemon's largest Subscribe buffer: a run never comes near it unless the reader stalls


class LandingLog:
    """A background reader of the daemon's events keeping the keys moved disk -> RAM in `NAMESPACE`, in order."""

    def __init__(self, client: Client) -> None:
        self.landed: list[bytes] = []
        self.gaps = 0
        self._done = threading.Event()
        self._stream = client.subscribe([NAMESPACE, SENTINEL_NS], buffer=_BUFFER)
        self._thread = threading.Thread(target=self._read, name="replay-landing", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for ev in self._stream:
            if ev.kind == "gap":
                self.gaps += ev.dropped
            elif ev.kind == "moved" and ev.namespace == NAMESPACE and (ev.tier, ev.to_tier) == ("disk", "ram"):
                self.landed.extend(ev.keys)
            elif ev.namespace == SENTINEL_NS and ev.kind == "stored":
                self._done.set()
                return

    def finish(self, client: Client, timeout_s: float = 30.0) -> list[bytes]:
        """Mark the end of the stream, wait for the reader to reach it, close; the landed keys in order."""
        client.register_namespace(SENTINEL_NS, model="trace-replay", layout_digest="landing-end")
        client.put(SENTINEL_NS, _SENTINEL_KEY, b"\0" * 4096)
        wait_until(self._done.is_set, timeout_s=timeout_s, interval_s=0.005, what="the event stream to catch up")
        self._stream.close()
        self._thread.join(timeout_s)
        if self.gaps:
            raise RuntimeError(f"the event stream dropped {self.gaps} events: the landing order is incomplete")
        return self.landed


def replay_observed(requests: Sequence[Request], spec: StoreSpec, *,
                    convention: Convention = Convention.FULL_BLOCKS, on_request: Callable[[], None] | None = None,
                    sync_leases: bool | None = None, hints: bool = False) -> tuple[ReplayResult, list[bytes]]:
    """replayer.replay, plus the promoted keys in the order the daemon inserted them into its policy."""
    landed: list[bytes] = []

    def watch(client: Client) -> Callable[[Client], None]:
        log = LandingLog(client)
        return lambda c: landed.extend(log.finish(c))

    result = replay(requests, spec, convention=convention, on_request=on_request, sync_leases=sync_leases,
                    hints=hints, watch=watch)
    return result, landed
