"""Prometheus metrics and /healthz over real HTTP while a scripted workload runs."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvstore.testing import DaemonProcess, wait_until

NS = "metrics/ns"


def _scrape(d: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _v(m, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def test_counters_move_by_exact_amounts(make_daemon, tmp_path) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes="64MiB", disk_segment_bytes="4MiB", disk_dir=str(tmp_path / "disk"), disk_sync="none")
    before = _scrape(d)
    assert _v(before, "kvstore_committed_blocks_total") == 0
    with d.client() as c:
        c.register_namespace(NS)
        keys = [b"m%02d" % i for i in range(20)]
        for i in range(0, 20, 4):  # 20 x 1 MiB into a 16-block arena, letting the writer keep up
            c.put_many(NS, keys[i:i + 4], [bytes([i]) * (1 << 20)] * 4)
            wait_until(lambda: c.stats().disk.write_queue_blocks == 0, timeout_s=30, what="disk writes")
        assert c.get_many(NS, keys[-3:]) is not None  # 3 RAM hits
        assert c.get(NS, keys[0]) == bytes([0]) * (1 << 20)  # 1 disk hit (promotion)
        assert c.get(NS, b"absent") is None
    m = _scrape(d)
    assert _v(m, "kvstore_committed_blocks_total") == 20
    assert _v(m, "kvstore_committed_bytes_total") == 20 << 20
    assert _v(m, "kvstore_lookup_keys_total") == 5
    assert _v(m, "kvstore_hit_keys_total", tier="ram") == 3
    assert _v(m, "kvstore_hit_keys_total", tier="disk") == 1
    assert _v(m, "kvstore_hit_bytes_total", tier="ram") == 3 << 20
    assert _v(m, "kvstore_hit_bytes_total", tier="disk") == 1 << 20
    assert _v(m, "kvstore_evictions_total") == 5  # 4 to fit the 20 puts, 1 for the promotion
    assert _v(m, "kvstore_evicted_to_disk_total") == 5
    assert _v(m, "kvstore_promotions_total") == 1
    assert _v(m, "kvstore_disk_writes_total") == 20
    assert _v(m, "kvstore_disk_blocks") == 20
    assert _v(m, "kvstore_namespace_hit_keys_total", namespace=NS) == 4
    assert _v(m, "kvstore_namespace_blocks", namespace=NS) == 16
    assert _v(m, "kvstore_arena_bytes", state="capacity") == 16 << 20
    assert _v(m, "kvstore_arena_bytes", state="stored") == 16 << 20
    assert _v(m, "kvstore_disk_degraded") == 0
    assert _v(m, "kvstore_arena_locked") in (0, 1)
    # one Reserve and one Commit per put_many, one Lookup per get: the histogram counted each RPC once
    assert _v(m, "kvstore_rpc_duration_seconds_count", method="Reserve") == 5
    assert _v(m, "kvstore_rpc_duration_seconds_count", method="Commit") == 5
    assert _v(m, "kvstore_rpc_duration_seconds_count", method="Lookup") == 3
    names = {name for name, _ in m}
    assert all(re.fullmatch(r"kvstore_[a-z0-9_]+", n) for n in names)


def test_healthz(make_daemon) -> None:
    d = make_daemon()
    with urllib.request.urlopen(d.metrics_url + "/healthz", timeout=10) as r:
        assert r.status == 200
        assert r.read().decode().strip() == "SERVING"
