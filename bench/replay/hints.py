"""Agent hints in the replay: what is sent to the store when (HintFeed), and the exact model of what the
daemon does with it (HintedLRU, apply_hint; kvstore/engine/hints.py and kvstore/policies/hinted.py). Under
S3-FIFO the RAM tier is sim_policy.HintedPolicyTier, which hands Retain and Release to the daemon's own
HintedPolicy class; the rules below are what that class does over LRU.

The clock is the trace's. A hint's ttl is in trace seconds (AgentX: a Retain lasts the agent's think time),
but the daemon times hints by its own monotonic clock, and the replay runs far faster (or, in a burst,
slower) than the trace. So the replay keeps the trace's clock itself, identically for the daemon and the model:
- a Retain is sent with ttl = hint_max_ttl_s (the daemon never ends it by itself within a run) and ended by
  the replay when the trace clock reaches its deadline: before the first request at or past it, a Retain
  with ttl EXPIRE_TTL_S (a billionth of a second: the entry is an ordinary one again by the next eviction);
  a Release or a later Retain of the key replaces that deadline, as in the daemon;
- a Pin is sent with ttl = hint_max_ttl_s too, and the generator's pins reach the trace's last call, so no pin
  ends within a run on either side (each session start renews the daemon's);
- Prefetch is not sent: in a replay the call it prepares follows at once, and its own probe promotes the same
  blocks (the hint would change no hit, only add a second probe's counters).

The model (the daemon's rules, per victim, one at a time):
  1. Released keys in release order (a key released again keeps its place), skipping keys the call holds
     and pinned ones; 2. the least recent key neither retained, pinned nor held; 3. under pressure the least
     recent key neither pinned nor held. An evicted key loses its hints; a new key has none.
Outcomes per key: in RAM: Retain/Pin/Release accepted (Pin rejected past the pin budget: half the arena,
counted in blocks of this store; a key pinned again counts once); on disk only: Retain and Pin rejected,
Release accepted; stored nowhere: missing. The model counts them under the daemon's counter names. A Release
lets go on both tiers: the disk copy is deleted and the RAM copy is written nowhere (CacheSim.let_go); a
later Retain or Pin of the RAM copy undoes the second part.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from bench.replay.keys import chain_keys
from bench.replay.sim import CacheSim, LRUTier, SimResult, SimTier, WritePlan, simulate
from bench.replay.sim_policy import HintedPolicyTier, HintPins, PolicyTier
from bench.replay.trace import Convention, Request

__all__ = ["Send", "HintFeed", "HintedLRU", "apply_hint", "simulate_hinted", "DAEMON_MAX_TTL_S", "EXPIRE_TTL_S"]

DAEMON_MAX_TTL_S = 600.0  # kvstore.engine.config.EngineConfig.hint_max_ttl_s (the daemon's default)
EXPIRE_TTL_S = 1e-9
SENT = ("retain", "release", "pin")


@dataclass(frozen=True)
class Send:
    """One Client.hint call: action, keys, ttl_s; `expire` marks the replay's end of earlier Retains."""

    action: str
    keys: tuple[bytes, ...]
    ttl_s: float
    expire: bool = False


class HintFeed:
    """The hints to send around each request, in order, with Retain deadlines kept on the trace's clock."""

    def __init__(self, max_ttl_s: float = DAEMON_MAX_TTL_S) -> None:
        self.max_ttl_s = max_ttl_s
        self._deadline: dict[bytes, int] = {}  # key -> its live Retain's deadline (trace ms)
        self._heap: list[tuple[int, int, bytes]] = []  # (deadline, order sent, key): ends in the order given
        self._sent = 0

    def before(self, r: Request) -> list[Send]:
        """Ends of the Retains whose deadline the request's timestamp reached (one call, deadline order)."""
        out: list[bytes] = []
        heap, dl = self._heap, self._deadline
        while heap and heap[0][0] < r.timestamp_ms:
            when, _, key = heapq.heappop(heap)
            if dl.get(key) == when:
                del dl[key]
                out.append(key)
        return [Send("retain", tuple(out), EXPIRE_TTL_S, expire=True)] if out else []

    def after(self, r: Request) -> list[Send]:
        """The request's own hints (Retain, Release, Pin), in the order the runtime gave them."""
        out: list[Send] = []
        for h in r.hints:
            if h.before or h.action not in SENT:
                continue
            keys = tuple(chain_keys(h.ids)[h.start:])
            if not keys:
                continue
            if h.action == "retain":
                when = r.timestamp_ms + round(h.ttl_s * 1000)
                for k in keys:
                    self._deadline[k] = when
                    self._sent += 1
                    heapq.heappush(self._heap, (when, self._sent, k))
            elif h.action == "release":
                for k in keys:
                    self._deadline.pop(k, None)
            out.append(Send(h.action, keys, self.max_ttl_s))
        return out


class HintedLRU(HintPins, LRUTier):
    """The RAM tier's LRU with the daemon's hint classes (see the module docstring)."""

    def __init__(self, name: str, capacity_blocks: int | None) -> None:
        super().__init__(name, capacity_blocks)
        self.released: OrderedDict[bytes, None] = OrderedDict()
        self.retained: set[bytes] = set()
        self.pinned: set[bytes] = set()

    def _forget(self, key: bytes) -> None:
        super()._forget(key)
        self.released.pop(key, None)
        self.retained.discard(key)

    def retain(self, key: bytes, ttl_s: float, expire: bool) -> None:
        """A Retain of an entry in RAM (`expire`: the replay ending an earlier one with a tiny ttl)."""
        self.released.pop(key, None)
        if expire:
            self.retained.discard(key)
        else:
            self.retained.add(key)

    def release(self, key: bytes) -> None:
        self.retained.discard(key)
        self.released.setdefault(key, None)

    def _victim(self, keep: Collection[bytes]) -> bytes | None:
        pinned = self.pinned
        for k in self.released:
            if k not in keep and k not in pinned:
                return k
        if self.retained:
            for k in self._od:
                if k not in keep and k not in pinned and k not in self.retained:
                    return k
        for k in self._od:
            if k not in keep and k not in pinned:
                return k
        return None


def apply_hint(sim: CacheSim, send: Send) -> list[str]:
    """The daemon's answer to `send`, key by key, applied to the model's RAM tier (a HintedLRU, or a
    HintedPolicyTier: S3-FIFO with the real HintedPolicy)."""
    ram, disk, c = sim.ram, sim.disk, sim.counters
    assert isinstance(ram, (HintedLRU, HintedPolicyTier)), "simulate_hinted puts a hinted RAM tier first"
    out: list[str] = []
    for k in send.keys:
        if k in ram:
            res = "clipped" if send.ttl_s > DAEMON_MAX_TTL_S else "accepted"
            if send.action == "retain":
                ram.retain(k, min(send.ttl_s, DAEMON_MAX_TTL_S), send.expire)
                sim.keep_again(k)
            elif send.action == "release":
                ram.release(k)
                sim.let_go(k)
                res = "accepted"
            elif not ram.pin(k):
                res = "rejected"
            else:
                sim.keep_again(k)
        elif disk is not None and k in disk:
            res = "accepted" if send.action == "release" else "rejected"
            if send.action == "release":
                sim.let_go(k)
        else:
            res = "missing"
        out.append(res)
        name = f"hint_{send.action}_{res}"
        c[name] = c.get(name, 0) + 1
    return out


def simulate_hinted(requests: Sequence[Request], tiers: Sequence[SimTier],
                    convention: Convention = Convention.FULL_BLOCKS,
                    landed: Sequence[bytes] | None = None, plan: WritePlan | None = None) -> SimResult:
    """`simulate` with the requests' hints sent as the replayer sends them (HintFeed), RAM as a HintedLRU (or,
    for a PolicyTier, a HintedPolicyTier of its policy); `landed` and `plan` as for `simulate`."""
    ram = tiers[0]
    hinted_ram: SimTier
    if isinstance(ram, PolicyTier):
        assert ram.capacity_blocks is not None
        hinted_ram = HintedPolicyTier(ram.name, ram.capacity_blocks, ram.policy_name)
    else:
        hinted_ram = HintedLRU(ram.name, ram.capacity_blocks)
    hinted: list[SimTier] = [hinted_ram, *tiers[1:]]
    feed = HintFeed()

    def on_hints(sim: CacheSim, r: Request, before: bool) -> None:
        for send in (feed.before(r) if before else feed.after(r)):
            apply_hint(sim, send)

    return simulate(requests, hinted, convention, on_hints=on_hints, landed=landed, plan=plan)
