"""Prometheus metrics and /healthz over real HTTP while a scripted workload runs."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client
from kvstore.testing import DaemonProcess, wait_until

NS = "metrics/ns"
KIB = 1 << 10
MIB = 1 << 20


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


def _xfer(m, name: str, plane: str, direction: str) -> float:
    """A kvstore_transfer_* sample of one data plane (tier follows from the plane today)."""
    return _v(m, name, plane=plane, tier="disk" if plane == "disk" else "ram", direction=direction)


def test_counters_move_by_exact_amounts(make_daemon, tmp_path) -> None:
    d = make_daemon(arena_bytes="16MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes="64MiB", disk_segment_bytes="4MiB", disk_dir=str(tmp_path / "disk"), disk_sync="none", disk_write="commit")
    before = _scrape(d)
    assert _v(before, "kvstore_committed_blocks_total") == 0
    with d.client() as c:
        c.register_namespace(NS, tokens_per_block=16)
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
    assert _v(m, "kvstore_disk_native_aio") == 1    # this machine allows io_setup (tests/test_disk_aio.py)
    assert _v(m, "kvstore_arena_locked") in (0, 1)
    # one Reserve and one Commit per put_many, one Lookup per get: the histogram counted each RPC once
    assert _v(m, "kvstore_rpc_duration_seconds_count", method="Reserve") == 5
    assert _v(m, "kvstore_rpc_duration_seconds_count", method="Commit") == 5
    assert _v(m, "kvstore_rpc_duration_seconds_count", method="Lookup") == 3
    # the same lookups in tokens (16 a block): 5 keys asked, 3 found in RAM, 1 on disk
    assert _v(m, "kvstore_lookup_tokens_total") == 80
    assert _v(m, "kvstore_hit_tokens_total", tier="ram") == 48
    assert _v(m, "kvstore_hit_tokens_total", tier="disk") == 16
    assert _v(m, "kvstore_namespace_lookup_tokens_total", namespace=NS) == 80
    assert _v(m, "kvstore_namespace_hit_tokens_total", namespace=NS, tier="ram") == 48
    assert _v(m, "kvstore_namespace_hit_tokens_total", namespace=NS, tier="disk") == 16
    # disk plane: 5 write batches (each put_many's 4 blocks are queued together and written in one batch
    # before the next put) and 1 read (the promotion); footprints are whole pages, here exactly 1 MiB
    assert _xfer(m, "kvstore_transfer_bytes_total", "disk", "in") == 20 * MIB
    assert _xfer(m, "kvstore_transfer_seconds_count", "disk", "in") == 5
    assert _xfer(m, "kvstore_transfer_gigabytes_per_second_count", "disk", "in") == 5
    assert _xfer(m, "kvstore_transfer_bytes_total", "disk", "out") == MIB
    assert _xfer(m, "kvstore_transfer_seconds_count", "disk", "out") == 1
    assert _xfer(m, "kvstore_transfer_seconds_sum", "disk", "out") > 0
    # arena plane: 5 Reserve -> Commit windows of 4 MiB; leases give out 3 MiB (RAM) + 1 MiB (promoted)
    assert _xfer(m, "kvstore_transfer_bytes_total", "arena", "in") == 20 * MIB
    assert _xfer(m, "kvstore_transfer_seconds_count", "arena", "in") == 5
    assert _xfer(m, "kvstore_transfer_bytes_total", "arena", "out") == 4 * MIB
    names = {name for name, _ in m}
    assert all(re.fullmatch(r"kvstore_[a-z0-9_]+", n) for n in names)


def test_healthz(make_daemon) -> None:
    d = make_daemon()
    with urllib.request.urlopen(d.metrics_url + "/healthz", timeout=10) as r:
        assert r.status == 200
        assert r.read().decode().strip() == "SERVING"


def test_lookups_in_tokens(make_daemon) -> None:
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB")
    keys = [b"t%d" % i for i in range(8)]
    with d.client() as c:
        c.register_namespace("tok/a", tokens_per_block=16)
        c.register_namespace("tok/none")  # no tokens_per_block: no token samples
        c.put_many("tok/a", keys[:5], [b"x" * (64 * KIB)] * 5)
        c.put_many("tok/none", keys[:5], [b"x" * (64 * KIB)] * 5)
        assert c.lookup_prefix("tok/a", keys) == 5  # a prefix of 8 keys with the first 5 present
        assert c.lookup_prefix("tok/none", keys) == 5
        ns = {n.name: n for n in c.stats().namespaces}
    assert (ns["tok/a"].tokens_per_block, ns["tok/a"].lookup_tokens, ns["tok/a"].hit_tokens) == (16, 128, 80)
    assert (ns["tok/none"].tokens_per_block, ns["tok/none"].lookup_tokens) == (0, None)
    m = _scrape(d)
    assert _v(m, "kvstore_lookup_keys_total") == 16
    assert _v(m, "kvstore_lookup_tokens_total") == 128  # 8 keys x 16 tokens, tok/none not counted
    assert _v(m, "kvstore_hit_tokens_total", tier="ram") == 80
    assert _v(m, "kvstore_hit_tokens_total", tier="disk") == 0
    assert _v(m, "kvstore_namespace_lookup_tokens_total", namespace="tok/a") == 128
    assert _v(m, "kvstore_namespace_hit_tokens_total", namespace="tok/a", tier="ram") == 80
    assert _v(m, "kvstore_namespace_tokens_per_block", namespace="tok/a") == 16
    assert not [k for k in m if k[0].startswith("kvstore_namespace_") and "tokens" in k[0]
                and ("namespace", "tok/none") in k[1]]
    assert not [k for k in m if k[0].startswith("kvstore_transfer_") and ("plane", "disk") in k[1]]  # no disk tier


def test_arena_and_stream_transfers(make_daemon) -> None:
    """One histogram observation per operation: a Reserve -> Commit, a lease -> Release, a Put or Get stream.
    A get answered from the key index (no lease) and a put through spare slots (one Store) count their bytes
    only: the daemon sees no window around the copy."""
    d = make_daemon(arena_bytes="8MiB", max_block_bytes="1MiB")
    size = 64 * KIB
    keys = [b"a%d" % i for i in range(5)]
    with d.client() as c, Client(d.address, mode="stream") as remote, \
            Client(d.address, mode="arena", control="grpc") as leased:
        assert c.mode == leased.mode == "arena" and c.probe_path == "index"
        c.register_namespace(NS)
        c.put_many(NS, keys, [b"a" * size] * 5)          # arena in through spare slots: 5 blocks' bytes, no window
        c.stats()  # the Store's keys are bound after its reply (engine/writes.py): indexed once Stats has the lock
        assert all(c.get_many(NS, keys))                  # arena out from the index: 5 blocks' bytes, no window
        c.stats()                                         # (waits for the get's one-way HITS)
        m = _scrape(d)
        for direction in ("in", "out"):
            assert _xfer(m, "kvstore_transfer_bytes_total", "arena", direction) == 5 * size
            assert _xfer(m, "kvstore_transfer_seconds_count", "arena", direction) == 0
        leased.put_many(NS, [b"w%d" % i for i in range(5)], [b"w" * size] * 5)  # arena in: one window, 5 blocks
        assert all(leased.get_many(NS, keys))             # arena out: one lease of 5 blocks
        assert c.lookup_prefix(NS, keys) == 5            # no lease: no transfer
        assert remote.put_many(NS, [b"s0", b"s1", b"s2"], [b"s" * size] * 3).stored == 3  # one Put stream
        assert all(remote.get_many(NS, [b"s0", b"s1", b"s2"]))  # one Get stream
        assert remote.get_many(NS, [b"nothing"]) == [None]      # a stream that moved nothing: not observed
        # the arena lease goes back asynchronously: wait for its Release to reach the daemon
        wait_until(lambda: _xfer(_scrape(d), "kvstore_transfer_seconds_count", "arena", "out") == 1,
                   timeout_s=10, what="the arena lease's release")
    m = _scrape(d)
    for plane, direction, ops, nbytes in (("arena", "in", 1, 10 * size), ("arena", "out", 1, 10 * size),
                                          ("stream", "in", 1, 3 * size), ("stream", "out", 1, 3 * size)):
        assert _xfer(m, "kvstore_transfer_bytes_total", plane, direction) == nbytes, (plane, direction)
        assert _xfer(m, "kvstore_transfer_seconds_count", plane, direction) == ops, (plane, direction)
        assert _xfer(m, "kvstore_transfer_gigabytes_per_second_count", plane, direction) == ops
        assert _xfer(m, "kvstore_transfer_gigabytes_per_second_sum", plane, direction) > 0
        assert _v(m, "kvstore_transfer_seconds_bucket", plane=plane, tier="ram", direction=direction,
                  le="+Inf") == ops
