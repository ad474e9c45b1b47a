"""kvstore_connector.stats.timed: a hook's wall time lands in its counter, also when the hook raises."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

import kvstore_connector.stats as stats
from kvstore_connector.stats import ConnectorCounters, timed


class _Hooks:
    def __init__(self) -> None:
        self.counters = ConnectorCounters()

    @timed("scheduler_hook_seconds")
    def lookup(self, n: int) -> tuple[int, bool]:
        return n * 2, False

    @timed("worker_hook_seconds")
    def save(self) -> None:
        raise RuntimeError("store down")


def test_timed_adds_each_calls_wall_time_to_its_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = itertools.count(0.0, 0.25)  # every clock read 0.25 s after the one before: each call takes 0.25 s
    here, real = threading.get_ident(), time.perf_counter  # the time module is shared: another thread still
    monkeypatch.setattr(stats.time, "perf_counter",       # alive from an earlier test must not take a tick
                        lambda: next(ticks) if threading.get_ident() == here else real())
    h = _Hooks()
    assert [h.lookup(i) for i in range(3)] == [(0, False), (2, False), (4, False)]
    with pytest.raises(RuntimeError, match="store down"):
        h.save()
    assert h.counters.totals == {"scheduler_hook_seconds": 0.75, "worker_hook_seconds": 0.25}
    assert h.counters.take() == {"scheduler_hook_seconds": 0.75, "worker_hook_seconds": 0.25}
    assert h.lookup.__name__ == "lookup"  # vLLM looks hooks up by name on the class


def test_timed_refuses_an_unknown_counter() -> None:
    with pytest.raises(KeyError, match="hook_secs"):
        timed("hook_secs")
