"""Churn during a replay: when each event happens, running it beside the replay, and what it cost.

The schedule: at 20 %, 40 %, 60 % and 80 % of the requests, in this order, a node joins, one is killed (-9),
one leaves gracefully (SIGTERM: it hands its blocks over first) and one is restarted (a leave, then the same
node id again, empty). Each event runs on a thread of its own while the replay goes on, as a real change lands
on a cluster that keeps serving; the replay never sends a request to a node being taken away (rig.py). The
churn replay is paced (`--churn-rate` requests per second): replayed back to back, the last fifth of the trace
took less time on this box than a restart takes, so the restart had not finished when the replay did.

What an event cost, from the per-request records (drive.Record) of the cluster and of the one-node
reference over the same requests (its hits are what capacity C gives these requests):
    failed / wrong   calls that raised, loaded blocks with wrong marks, from the event to the next one
    level            the cluster's hit blocks / the reference's over the WINDOW requests before the event
    after            the same over the second half of the requests from the event to the next one: where the
                     cluster settled (a kill or a leave takes a node's capacity with it, so it may settle lower)
    dip              `level` less the lowest level of any WINDOW requests from the event to the next one
    back_s           seconds from the event to the end of the first of SUSTAIN back-to-back WINDOWs (before
                     the next event) whose levels all stay within the tolerance of min(level, after): back, and
                     staying back for SUSTAIN x WINDOW requests (None: never before the next event). The
                     tolerance is the steady state's own noise: twice the standard deviation of the window
                     levels before the first event (at least TOLERANCE), so "back" means back within what the
                     cluster varies by when nothing happens. (Until every later window to the next event had to
                     stay above it: one noisy window near the end then set back_s to the whole gap between
                     events, however early the level came back; paced at 40 requests/s, 11-13.6 s of 13.6.)
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.cluster.drive import Record
from bench.cluster.rig import Rig

__all__ = ["Churn", "Event", "EventCost", "costs", "noise", "WINDOW", "SUSTAIN", "TOLERANCE"]

FRACTIONS = (0.2, 0.4, 0.6, 0.8)
KINDS = ("join", "kill", "leave", "restart")
WINDOW = 40
SUSTAIN = 3
TOLERANCE = 0.05


@dataclass
class Event:
    kind: str
    index: int            # the request after which it started
    node: str = ""
    t_start: float = 0.0  # seconds into the run
    t_done: float = 0.0   # when the event itself had finished (a leave's hand-off, a daemon's start)
    error: str = ""


@dataclass
class EventCost:
    kind: str
    node: str
    at_s: float
    took_s: float
    failed: int
    wrong: int
    level: float
    after: float
    dip: float
    back_s: float | None
    extra: dict[str, int] = field(default_factory=dict)


class Churn:
    """Runs the schedule against a Rig from the replay's on_request hook."""

    def __init__(self, rig: Rig, requests: int) -> None:
        self._rig = rig
        self.events = [Event(kind, int(f * requests)) for kind, f in zip(KINDS, FRACTIONS)]
        self._pending = list(self.events)
        self._threads: list[threading.Thread] = []
        self._start = time.perf_counter()

    def on_request(self, i: int, t: float) -> None:
        while self._pending and self._pending[0].index <= i:
            ev = self._pending.pop(0)
            for th in self._threads:  # one event at a time: the next waits for the last to finish
                th.join()
            ev.t_start = t
            th = threading.Thread(target=self._run, args=(ev, t), name=f"churn-{ev.kind}", daemon=True)
            self._threads.append(th)
            th.start()

    def _run(self, ev: Event, t0: float) -> None:
        began = time.perf_counter()
        rig = self._rig
        originals = sorted(n for n in rig.live if n in rig.first_nodes)
        try:
            if ev.kind == "join":
                ev.node = rig.join()
            elif ev.kind == "kill":
                ev.node = originals[1]
                rig.kill(ev.node)
            elif ev.kind == "leave":
                ev.node = originals[2] if len(originals) > 2 else originals[-1]
                rig.leave(ev.node)
            else:
                ev.node = originals[0]
                rig.restart(ev.node)
        except Exception as exc:  # the run reports it; the replay goes on
            ev.error = repr(exc)
        ev.t_done = t0 + (time.perf_counter() - began)

    def finish(self) -> None:
        for th in self._threads:
            th.join()


def _level(cl: Sequence[Record], ref: Sequence[int], lo: int, hi: int) -> float | None:
    want = sum(ref[lo:hi])
    return sum(r.hit for r in cl[lo:hi]) / want if want else None


def noise(events: Sequence[Event], cl: Sequence[Record], ref: Sequence[int]) -> float:
    """The tolerance: twice the spread of the window levels before the first event, at least TOLERANCE."""
    first = events[0].index if events else len(cl)
    levels = [lv for j in range(0, max(0, first - WINDOW)) if (lv := _level(cl, ref, j, j + WINDOW)) is not None]
    return max(TOLERANCE, 2 * statistics.pstdev(levels)) if len(levels) > 1 else TOLERANCE


def _back(cl: Sequence[Record], ref: Sequence[int], lo: int, hi: int, floor: float) -> int | None:
    """The first request j in [lo, hi) that starts SUSTAIN back-to-back windows, all inside [lo, hi), each at
    or above `floor` (a window the reference has no hits in counts as above)."""
    for j in range(lo, hi - SUSTAIN * WINDOW + 1):
        levels = [_level(cl, ref, j + k * WINDOW, j + (k + 1) * WINDOW) for k in range(SUSTAIN)]
        if all(lv is None or lv >= floor for lv in levels):
            return j
    return None


def costs(events: Sequence[Event], cl: Sequence[Record], ref: Sequence[int]) -> list[EventCost]:
    tol = noise(events, cl, ref)
    out = []
    for k, ev in enumerate(events):
        end = events[k + 1].index if k + 1 < len(events) else len(cl)
        before = _level(cl, ref, max(0, ev.index - WINDOW), ev.index) or 0.0
        after = _level(cl, ref, (ev.index + end) // 2, end) or 0.0
        levels = [(j, _level(cl, ref, j, j + WINDOW)) for j in range(ev.index, max(ev.index + 1, end - WINDOW + 1))]
        seen = [lv for _, lv in levels if lv is not None]
        floor = min(before, after) - tol
        back = _back(cl, ref, ev.index, end, floor)
        back_s = (max(0.0, cl[min(back + WINDOW, len(cl)) - 1].t - ev.t_start) if back is not None else None)
        part = cl[ev.index:end]
        out.append(EventCost(ev.kind, ev.node, ev.t_start, ev.t_done - ev.t_start, sum(r.failed for r in part),
                             sum(r.wrong for r in part), round(before, 4), round(after, 4),
                             round(max(0.0, before - min(seen)), 4) if seen else 0.0,
                             None if back_s is None else round(back_s, 2)))
    return out
