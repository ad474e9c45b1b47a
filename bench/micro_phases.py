"""bench.micro's view inside a client call: wall time per phase (control round trips, copies) and CPU per process.

Why both: wall time per phase says what the caller waits for; CPU time of the daemon and of the client, read from
schedstat (ns resolution), says what the work itself costs, and unlike wall time it does not grow when neighbours
steal the 2 cores.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.client import Client, arena_path
from kvstore.fastpath import protocol as fp

__all__ = ["PhaseClock", "phases", "cpu_ns", "rss_anon"]

_CONTROL_OPS = ("reserve", "commit", "abort", "lookup", "release")


class PhaseClock:
    """Times a client's control-plane calls and copies inside put_many / get_many_into, by shadowing the bound
    methods on this one client's instances (private attributes: this is a benchmark, it must see the real call
    path), whichever control path it uses; a Release sent by the client's background thread is labelled
    "(background)": it overlaps the caller's work."""

    def __init__(self, c: Client) -> None:
        assert c.mode == "arena", "phases are for the arena path"
        self.c = c
        self.acc: dict[str, float] = defaultdict(float)
        self._wrapped: list[tuple[Any, str, Any]] = []
        control = c._control
        for op in _CONTROL_OPS:
            def label(a: tuple[Any, ...], op: str = op) -> str:
                return op.capitalize()  # the row says which path
            self._wrap(control, op, label)
        self._wrap(control, "lookup_here", lambda a: "index read")     # a get answered from the key index
        channel = getattr(control, "channel", None)
        if channel is not None:  # the fast path's requests on a named connection: Spare, Store (spare_puts.py),
            # sent without waiting (a put of several parts sends each as soon as it is copied), answered in order
            self._wrap(channel, "send_on", lambda a: fp.OP_NAMES.get(a[1], "?") + " send")
            self._wrap(channel, "reply_on", lambda a: "waiting for replies")
        self._wrap(c._releaser, "submit", lambda a: "Release async")  # only the queueing, as the caller sees it
        self._wrap(c, "_write", lambda a: "copy")                     # mapping acquired + copy_addrs
        self._wrap(arena_path.SlotWriter, "copy", lambda a: "copy")   # copy_addrs into spare slots, part by part
        self._wrap(c, "_read", lambda a: "copy+gen check")

    def _wrap(self, obj: Any, name: str, label: Callable[[tuple[Any, ...]], str]) -> None:
        """The background Release calls the same method as the caller's: the thread that runs it tells them apart."""
        orig = getattr(obj, name)
        caller = threading.get_ident()

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                bg = "" if threading.get_ident() == caller else " (background)"
                self.acc[label(a) + bg] += time.perf_counter() - t0
        setattr(obj, name, timed)
        self._wrapped.append((obj, name, orig))

    def close(self) -> None:
        for obj, name, orig in self._wrapped:
            if isinstance(obj, type):  # a class's method: put it back
                setattr(obj, name, orig)
            else:  # an instance's shadow of its class's method: drop it
                delattr(obj, name)


def phases(c: Client, daemon_pid: int, op: Callable[[], object], iters: int) -> dict[str, float]:
    """Median wall microseconds of each phase of `op` over `iters` runs ('client other' is the unaccounted
    rest), plus the daemon's and this process's mean CPU microseconds per op."""
    clock, per = PhaseClock(c), defaultdict(list)
    cpu0, me0 = cpu_ns(daemon_pid), time.process_time()
    try:
        for _ in range(iters):
            clock.acc.clear()
            t0 = time.perf_counter()
            op()
            total = time.perf_counter() - t0
            for k, v in clock.acc.items():
                per[k].append(v)
            per["client other"].append(total - sum(v for k, v in clock.acc.items() if "background" not in k))
            per["total"].append(total)
    finally:
        clock.close()
    cpu1, me1 = cpu_ns(daemon_pid), time.process_time()
    out = {k: round(float(np.median(v)) * 1e6, 1) for k, v in per.items()}
    out["daemon CPU"] = round((cpu1 - cpu0) / iters / 1e3, 1)
    out["client CPU"] = round((me1 - me0) / iters * 1e6, 1)
    return out


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of all of a process's threads (schedstat: ns resolution, unlike the 10 ms ticks of
    /proc/PID/stat, so a handful of calls can be costed)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except OSError:
            pass  # the thread ended between listdir and open
    return total


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon in /proc/{pid}/status")
