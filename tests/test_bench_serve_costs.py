"""bench.serve.costs: hook seconds from a real /metrics endpoint and a process's CPU time, over the time spent
inside the meter, exact with a stepped clock."""

from __future__ import annotations

import http.server
import itertools
import threading
from collections.abc import Iterator

import pytest

import bench.serve.costs as costs
from bench.serve.costs import HOOK_COUNTERS, CostMeter


class _Metrics:
    """A /metrics endpoint whose two hook counters the test sets (two engines' label sets each, summed)."""

    def __init__(self) -> None:
        self.values = {HOOK_COUNTERS[0]: 1.0, HOOK_COUNTERS[1]: 2.0}
        me = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = "".join(f'{k}{{engine="{e}",model_name="m"}} {v / 2}\n' for k, v in me.values.items()
                               for e in (0, 1)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/metrics"


@pytest.fixture()
def metrics() -> Iterator[_Metrics]:
    m = _Metrics()
    yield m
    m.srv.shutdown()


def test_hook_share_and_daemon_cpu_over_the_time_inside(metrics: _Metrics, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = iter([5_000_000_000, 5_600_000_000])  # the daemon's CPU ns at the start and at the result: 0.6 s
    monkeypatch.setattr(costs, "cpu_ns", lambda pid: next(cpu))
    clock = itertools.count(100.0, 10.0)  # each perf_counter read 10 s after the last: each inside() lasts 10 s
    monkeypatch.setattr(costs.time, "perf_counter", lambda: next(clock))
    m = CostMeter(metrics.url, daemon_pid=1234)
    with m.inside():
        metrics.values[HOOK_COUNTERS[0]] += 0.05
    with m.inside():
        metrics.values[HOOK_COUNTERS[1]] += 0.15
    # time outside the meter (the server without the connector ran) adds nothing to wall_s
    assert m.result() == {"wall_s": 20.0, "scheduler_hook_s": 0.05, "worker_hook_s": 0.15, "hook_share": 0.01,
                          "daemon_cpu_s": 0.6, "daemon_cpu_share": 0.03}


def test_result_waits_for_the_last_steps_stats(metrics: _Metrics, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(costs, "cpu_ns", lambda pid: 0)
    m = CostMeter(metrics.url, daemon_pid=1234)
    with m.inside():
        pass
    # the last step's stats are recorded a moment after its reply: the meter reads until two reads agree
    threading.Timer(0.1, lambda: metrics.values.__setitem__(HOOK_COUNTERS[1], 2.5)).start()
    got = m.result()
    assert got["worker_hook_s"] == 0.5 and got["scheduler_hook_s"] == 0.0


def test_an_error_inside_still_counts_its_time(metrics: _Metrics, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(costs, "cpu_ns", lambda pid: 0)
    clock = itertools.count(0.0, 4.0)
    monkeypatch.setattr(costs.time, "perf_counter", lambda: next(clock))
    m = CostMeter(metrics.url, daemon_pid=1)
    with pytest.raises(ValueError):
        with m.inside():
            raise ValueError("server died")
    assert m.wall_s == 4.0
