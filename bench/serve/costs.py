"""What the connector costs where nothing hits, measured exactly rather than read off throughput.

The no-reuse rounds compare throughput with and without the connector, and on a shared 2-core VM the same
round moves by +-20 % from one run to the next (the engine's CPU time for the same work doubles for minutes
at a time, on either server), so a cost of ~1 % cannot show in that ratio. Here the same rounds are costed
directly on the connector's server: the wall time vLLM's scheduler and worker threads spent inside the
connector's hooks (kvstore_connector/stats.py `timed`, read from vLLM's /metrics), and the daemon's CPU time (/proc),
both over the time that server spent on the rounds (warm-ups included: their hooks count too).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.micro_phases import cpu_ns
from bench.serve.scrape import delta, scrape

__all__ = ["CostMeter", "HOOK_COUNTERS"]

HOOK_COUNTERS = ("vllm:kvstore_scheduler_hook_seconds_total", "vllm:kvstore_worker_hook_seconds_total")


class CostMeter:
    """Hook seconds and daemon CPU over the time spent `inside()`; `result()` after the last of it."""

    def __init__(self, metrics_url: str, daemon_pid: int) -> None:
        self.url, self.pid = metrics_url, daemon_pid
        self.wall_s = 0.0
        self._hooks0 = scrape(self.url, HOOK_COUNTERS)
        self._cpu0 = cpu_ns(self.pid)

    @contextmanager
    def inside(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wall_s += time.perf_counter() - t0

    def _settled_hooks(self, timeout_s: float = 5.0) -> dict[str, float]:
        """vLLM's /metrics after the last step's stats arrived: they travel with that step's outputs and may be
        recorded just after the reply went out, so read until two reads 0.3 s apart agree."""
        last = scrape(self.url, HOOK_COUNTERS)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = scrape(self.url, HOOK_COUNTERS)
            if now == last:
                break
            last = now
        return last

    def result(self) -> dict[str, Any]:
        cpu_s = (cpu_ns(self.pid) - self._cpu0) / 1e9
        d = delta(self._hooks0, self._settled_hooks())
        sched, worker = (d.get(k, 0.0) for k in HOOK_COUNTERS)
        wall = max(self.wall_s, 1e-9)
        return {"wall_s": round(self.wall_s, 2), "scheduler_hook_s": round(sched, 4), "worker_hook_s": round(worker, 4),
                "hook_share": round((sched + worker) / wall, 4), "daemon_cpu_s": round(cpu_s, 3),
                "daemon_cpu_share": round(cpu_s / wall, 4)}
