"""The disk tier through a real daemon: write-behind, promotion, restarts, crashes, corruption, faults.

These run under disk_write = commit (write-behind), the mode whose behaviour they pin down; disk_write = evict
has its own daemon tests (test_disk_write_daemon.py, test_disk_write_crash.py).

Arena: 16 MiB of 1 MiB slabs (16 blocks of 1 MiB). Disk: 64 MiB in 4 MiB segments, under the test's
directory. Block contents are a pure function of the key, so any read can be checked without bookkeeping.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.testing import wait_until

NS = "disk/ns"
BLOCK = 1 << 20


def _value(key: bytes, size: int = BLOCK) -> bytes:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return random.Random(seed).randbytes(size)


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:04d}".encode() for i in range(n)]


def _disk_opts(disk_dir: str, **extra: object) -> dict[str, object]:
    opts: dict[str, object] = dict(arena_bytes="16MiB", max_block_bytes="1MiB", disk_bytes="64MiB",
                                   disk_segment_bytes="4MiB", disk_dir=disk_dir, disk_sync="data",
                                   high_watermark=1.0, low_watermark=1.0, disk_write="commit")
    opts.update(extra)
    return opts


def _drain_writes(c, expect_blocks: int | None = None) -> None:
    """Wait until the write-behind queue is empty (and the disk holds `expect_blocks`)."""
    def done() -> bool:
        d = c.stats().disk
        return d.write_queue_blocks == 0 and (expect_blocks is None or d.blocks == expect_blocks)
    wait_until(done, timeout_s=30, what="disk writes to finish")


def _put_through(c, keys: list[bytes], batch: int = 8) -> None:
    """Put in batches smaller than the arena, letting each land on disk before the next evicts it."""
    for i in range(0, len(keys), batch):
        part = keys[i: i + batch]
        assert c.put_many(NS, part, [_value(k) for k in part]).stored == len(part)
        _drain_writes(c)


def test_spill_and_promote_round_trip(make_daemon, tmp_path) -> None:
    d = make_daemon(**_disk_opts(str(tmp_path / "disk")))
    with d.client() as c:
        c.register_namespace(NS)
        keys = _keys(48)  # 3x the arena
        _put_through(c, keys)
        _drain_writes(c, expect_blocks=48)
        s = c.stats()
        assert s.blocks == 16  # the arena holds the newest 16
        assert s.counters["evicted_to_disk"] == 32
        assert s.counters["demote_dropped"] == 0
        # the oldest block is on disk only; a lookup reports the tier and a get promotes it
        lease = c.lookup(NS, [keys[0], keys[47], b"nowhere"], lease=False)
        assert lease.tiers == [2, 1, 0]
        assert c.get(NS, keys[0]) == _value(keys[0])
        # every block comes back with exact bytes, in chunks that fit the arena
        for i in range(0, 48, 8):
            assert c.get_many(NS, keys[i: i + 8]) == [_value(k) for k in keys[i: i + 8]]
        s = c.stats()
        assert s.counters["promotions"] >= 32
        assert s.counters["promotion_failures"] == 0
        assert s.disk.checksum_failures == 0
        tiers = {k.key: k.tier for k in c.keys(NS)}
        assert len(tiers) == 48 and set(tiers.values()) <= {"disk", "ram+disk"}
        assert sum(t == "ram+disk" for t in tiers.values()) == 16


def test_prefix_probe_prefetches_into_ram(make_daemon, tmp_path) -> None:
    d = make_daemon(**_disk_opts(str(tmp_path / "disk")))
    with d.client() as c:
        c.register_namespace(NS)
        chain = _keys(24, "chain")
        _put_through(c, chain)
        _drain_writes(c, expect_blocks=24)
        head = chain[:8]  # evicted from RAM by the 16 later blocks
        assert c.lookup(NS, head, lease=False).tiers == [2] * 8
        # disk hits count, and the probe says they are not all in RAM (the connector then loads them
        # asynchronously); it starts their promotion
        assert c.probe_prefix(NS, head + [b"missing"] + chain[8:]) == (8, False)
        wait_until(lambda: c.lookup(NS, head, lease=False).tiers == [1] * 8, timeout_s=10,
                   what="prefetch into RAM")
        assert c.probe_prefix(NS, head + [b"missing"]) == (8, True) and c.lookup_prefix(NS, head) == 8
        assert c.get_many(NS, head) == [_value(k) for k in head]


def test_restart_keeps_the_disk_tier_and_wipe_empties_it(make_daemon, tmp_path) -> None:
    disk_dir = str(tmp_path / "disk")
    d = make_daemon(**_disk_opts(disk_dir))
    keys = _keys(20)
    with d.client() as c:
        c.register_namespace(NS, model="m", layout_digest="L", disk_codec="zstd")
        _put_through(c, keys)
        _drain_writes(c, expect_blocks=20)
    assert d.stop(signal.SIGTERM) == 0
    d2 = make_daemon(**_disk_opts(disk_dir))
    with d2.client() as c:
        s = c.stats()
        assert s.blocks == 0 and s.disk.blocks == 20  # RAM starts empty; the disk tier is back
        assert [n.name for n in s.namespaces] == [NS]
        c.register_namespace(NS, model="m", layout_digest="L")  # adopts the recovered namespace
        assert c.get_many(NS, keys[:10]) == [_value(k) for k in keys[:10]]
        assert {k.tier for k in c.keys(NS)} >= {"disk"}
    d2.stop(signal.SIGTERM)
    d3 = make_daemon(**_disk_opts(disk_dir, disk_wipe=True))
    with d3.client() as c:
        assert c.stats().disk.blocks == 0
        assert c.stats().namespaces == []


_STORM = textwrap.dedent("""
    import hashlib, random, sys
    from kvstore import Client
    def value(key):
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
        return random.Random(seed).randbytes(1 << 20)
    c = Client(sys.argv[1])
    c.register_namespace("disk/ns")
    i = 0
    while True:
        keys = [b"storm%06d" % (i + j) for j in range(4)]
        c.put_many("disk/ns", keys, [value(k) for k in keys])
        i += 4
        if i == 16:
            print("running", flush=True)
""")


def test_kill9_during_write_storm_serves_only_correct_bytes(make_daemon, tmp_path) -> None:
    disk_dir = str(tmp_path / "disk")
    for round_ in range(2):
        d = make_daemon(**_disk_opts(disk_dir))
        writer = subprocess.Popen([sys.executable, "-c", _STORM, d.address], stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None and writer.stdout.readline().strip() == "running"
        with d.client() as c:
            wait_until(lambda: c.stats().disk.blocks >= 8 * (round_ + 1), timeout_s=30, what="disk writes")
        d.stop(signal.SIGKILL)
        writer.kill()
        writer.wait()
        d2 = make_daemon(**_disk_opts(disk_dir))
        with d2.client() as c:
            c.register_namespace("disk/ns")
            listed = [k.key for k in c.keys("disk/ns")]
            assert len(listed) >= 8
            served = 0
            for i in range(0, len(listed), 8):
                part = listed[i: i + 8]
                for key, got in zip(part, c.get_many("disk/ns", part)):
                    if got is not None:
                        assert got == _value(key), f"wrong bytes for {key!r} after kill -9"
                        served += 1
            assert served == len(listed)  # every indexed block is whole
            assert c.stats().disk.checksum_failures == 0
        d2.stop(signal.SIGTERM)


def test_corrupted_segment_is_a_miss_and_a_counter_never_bad_bytes(make_daemon, tmp_path) -> None:
    disk_dir = str(tmp_path / "disk")
    d = make_daemon(**_disk_opts(disk_dir))
    keys = _keys(4)
    with d.client() as c:
        c.register_namespace(NS)
        _put_through(c, keys, batch=4)
        _drain_writes(c, expect_blocks=4)
    d.stop(signal.SIGTERM)
    segments = [p for p in glob.glob(os.path.join(disk_dir, "**", "*"), recursive=True)
                if os.path.isfile(p) and os.path.getsize(p) >= 4 << 20]
    assert segments, "no segment file found"
    with open(segments[0], "r+b") as fh:  # flip bytes inside the first block
        fh.seek(4096)
        data = bytearray(fh.read(16))
        fh.seek(4096)
        fh.write(bytes(b ^ 0xFF for b in data))
    d2 = make_daemon(**_disk_opts(disk_dir))
    with d2.client() as c:
        c.register_namespace(NS)
        got = c.get_many(NS, keys)
        assert sum(g is None for g in got) == 1
        assert all(g == _value(k) for k, g in zip(keys, got) if g is not None)
        s = c.stats()
        assert s.counters["checksum_failures"] == 1
        assert s.disk.checksum_failures == 1
        assert s.disk.blocks == 3  # the damaged record was dropped


def test_compression_per_namespace(make_daemon, tmp_path) -> None:
    d = make_daemon(**_disk_opts(str(tmp_path / "disk")))
    with d.client() as c:
        c.register_namespace("disk/z", disk_codec="zstd-shuffle2")
        # bf16-like data: random low bytes, repetitive high bytes (exponents) -> shuffling helps zstd
        rng = np.random.default_rng(0)
        vals = (rng.normal(0, 1, size=(8, BLOCK // 2)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        blocks = [v.tobytes() for v in vals]
        keys = _keys(8, "z")
        assert c.put_many("disk/z", keys, blocks).stored == 8
        _drain_writes(c, expect_blocks=8)
        disk = c.stats().disk
        assert disk.compression_ratio > 1.2
        assert c.delete("disk/z", keys) == 8
        assert c.stats().disk.blocks == 0


def test_admission_seen_twice(make_daemon, tmp_path) -> None:
    d = make_daemon(**_disk_opts(str(tmp_path / "disk"), disk_admission="seen:2"))
    with d.client() as c:
        c.register_namespace(NS)
        keys = _keys(4)
        c.put_many(NS, keys, [_value(k) for k in keys])
        _drain_writes(c)
        assert c.stats().disk.blocks == 0  # put once: not admitted
        assert c.get(NS, keys[0]) == _value(keys[0])  # second use
        _drain_writes(c, expect_blocks=1)
        assert [k.tier for k in c.keys(NS)] == ["ram+disk", "ram", "ram", "ram"]


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path], capture_output=True)
    return r.returncode == 0


def test_disk_full_degrades_then_recovers(make_daemon, tmp_path) -> None:
    mnt = str(tmp_path / "small")
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "12m"):
        pytest.skip("needs root to mount a size-limited tmpfs (CI and dev machines here run as root)")
    try:
        filler = os.path.join(mnt, "filler")
        with open(filler, "wb") as fh:
            fh.write(b"\0" * (6 << 20))
        d = make_daemon(**_disk_opts(os.path.join(mnt, "disk"), disk_probe_interval_s=0.2))
        with d.client() as c:
            c.register_namespace(NS)
            keys = _keys(12)
            for k in keys:  # 12 MiB of blocks into ~6 MiB of free space
                c.put(NS, k, _value(k))
                _drain_writes(c)
            h = c.health()
            assert h.status == "DEGRADED" and h.detail
            assert c.stats().disk.degraded
            assert c.get(NS, keys[-1]) == _value(keys[-1])  # RAM keeps serving
            os.unlink(filler)
            wait_until(lambda: c.health().status == "SERVING", timeout_s=15, what="disk tier recovery")
            more = _keys(2, "after")
            c.put_many(NS, more, [_value(k) for k in more])
            wait_until(lambda: all(k.tier == "ram+disk" for k in c.describe(NS, more) if k), timeout_s=15,
                       what="writes after recovery")
        assert "disk tier" in d.log() or "degraded" in d.log().lower()
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)
