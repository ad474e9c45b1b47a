"""disk_write = evict and the write budget through a real daemon: what Stats, /metrics and `kvstore stats` report.

Arena: 16 blocks of 1 MiB, watermarks 1.0 (only a Reserve evicts); disk 64 MiB in 4 MiB segments. A budget of
17,477 bytes/s over a 60 s window is 1,048,620 bytes a window: one 1 MiB block, not two. So of three victims
one is written and two are refused (dropped), whatever the clock does in between (a window is a minute).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.cli.main import main
from kvstore.testing import DaemonProcess

NS = "evict/ns"
MIB = 1 << 20


def _metrics(d: DaemonProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_evictions_under_a_budget_are_counted_everywhere(make_daemon, tmp_path, capsys) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", disk_bytes="64MiB", disk_segment_bytes="4MiB",
                    disk_dir=str(tmp_path / "disk"), disk_sync="none", high_watermark=1.0, low_watermark=1.0,
                    disk_write_budget="17477", disk_write_budget_window_s=60)
    keys = [f"k{i:02d}".encode() for i in range(19)]
    with d.client() as c:
        c.register_namespace(NS)
        for i in range(0, 16, 4):
            assert c.put_many(NS, keys[i:i + 4], [bytes([i]) * MIB] * 4).stored == 4
        assert c.stats().disk.blocks == 0                      # nothing written at commit
        assert c.put_many(NS, keys[16:], [b"\x07" * MIB] * 3).stored == 3  # evicts k00 (written), k01, k02
        s, m = c.stats(), _metrics(d)
        assert c.exists(NS, keys[1:3]) == [False, False]       # refused by the budget: dropped
        assert c.get(NS, keys[0]) == b"\x00" * MIB             # read back from disk (its promotion evicts k03:
        # refused too, the window is spent)
    cnt = {k: s.counters[k] for k in ("disk_writes", "disk_writebacks", "evicted_unwritten", "evictions",
                                      "evicted_to_disk", "room_waits")}
    assert cnt == {"disk_writes": 1, "disk_writebacks": 1, "evicted_unwritten": 2, "evictions": 3,
                   "evicted_to_disk": 1, "room_waits": 1}
    d_ = s.disk
    assert d_ is not None and (d_.write_mode, d_.admission, d_.writeback_blocks, d_.blocks) == ("evict", "always", 0, 1)
    b = d_.budget
    assert b is not None
    assert (b.bytes_per_s, b.window_s, b.window_target, b.window_admitted) == (17477, 60.0, 1_048_620, MIB)
    assert (b.admitted_blocks, b.admitted_bytes, b.refused_blocks, b.refused_bytes) == (1, MIB, 2, 2 * MIB)
    assert m[("kvstore_disk_write_mode", (("mode", "evict"),))] == 1
    assert m[("kvstore_disk_write_mode", (("mode", "commit"),))] == 0
    assert m[("kvstore_disk_writebacks_total", ())] == 1
    assert m[("kvstore_evicted_unwritten_total", ())] == 2
    assert m[("kvstore_disk_budget_blocks_total", (("decision", "admitted"),))] == 1
    assert m[("kvstore_disk_budget_blocks_total", (("decision", "refused"),))] == 2
    assert m[("kvstore_disk_budget_bytes_total", (("decision", "refused"),))] == 2 * MIB
    assert m[("kvstore_disk_budget_bytes_per_second", ())] == 17477
    assert m[("kvstore_disk_budget_window_bytes", (("state", "target"),))] == 1_048_620
    capsys.readouterr()
    assert main(["--address", d.address, "stats"]) == 0
    out = capsys.readouterr().out
    assert "disk_write evict, admission always" in out
    assert "write budget" in out and "17.1 KiB/s" in out and "budget admitted / refused" in out
    assert main(["--address", d.address, "--json", "stats"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["disk"]["write_mode"] == "evict" and doc["disk"]["budget"]["refused_blocks"] == 3  # k03 too


@pytest.mark.parametrize("mode", ["commit", "evict"])
def test_stats_say_which_mode_runs(make_daemon, tmp_path, mode: str) -> None:
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB", disk_bytes="16MiB", disk_segment_bytes="4MiB",
                    disk_dir=str(tmp_path / "disk"), disk_sync="none", disk_write=mode)
    with d.client() as c:
        s = c.stats()
    assert s.disk is not None and (s.disk.write_mode, s.disk.budget) == (mode, None)
