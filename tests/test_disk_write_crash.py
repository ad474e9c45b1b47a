"""What survives a kill -9, per disk_write mode (the guarantee in docs/architecture.md), through a real daemon.

Arena: 16 blocks of 1 MiB; disk: 64 MiB in 4 MiB segments, disk_sync = data. Block contents are a pure function
of the key. Each test pins 4 blocks P (never evicted), puts 20 blocks A, lets the disk writer drain, and reads
which blocks have a disk copy; then a loader process puts new blocks B and reads P back while the daemon is
killed with SIGKILL in the middle of it. A daemon restarted on the same directory must serve:

    every block that had a disk copy before the load (`confirmed`), and nothing that was never acknowledged;
    commit: P and A too (each was written soon after its commit, and the writer had drained);
    evict:  never P (a block only in RAM dies with the daemon: the pinned blocks were never evicted, so never
            written), but A's blocks RAM evicted before the kill (written before their slot was reused);
and every block it serves has exactly the bytes that were stored (no wrong byte in any mode).
"""

from __future__ import annotations

import hashlib
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from kvstore.testing import wait_until

pytestmark = pytest.mark.timeout(180)

NS = "crash/ns"
BLOCK = 1 << 20


def _value(key: bytes) -> bytes:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return random.Random(seed).randbytes(BLOCK)


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i:04d}".encode() for i in range(n)]


def _opts(disk_dir: str, mode: str) -> dict[str, object]:
    return dict(arena_bytes="16MiB", max_block_bytes="1MiB", disk_bytes="64MiB", disk_segment_bytes="4MiB",
                disk_dir=disk_dir, disk_sync="data", high_watermark=1.0, low_watermark=1.0, disk_write=mode)


_LOAD = textwrap.dedent("""
    import hashlib, random, sys
    from kvstore import Client
    def value(key):
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
        return random.Random(seed).randbytes(1 << 20)
    c = Client(sys.argv[1])
    c.register_namespace("crash/ns")
    pinned = [b"P%04d" % i for i in range(4)]
    i = 0
    while True:
        keys = [b"B%04d" % (i + j) for j in range(2)]
        c.put_many("crash/ns", keys, [value(k) for k in keys])
        print("put", *[k.decode() for k in keys], flush=True)
        assert c.get_many("crash/ns", pinned) == [value(k) for k in pinned]
        i += 2
        if i == 6:
            print("running", flush=True)
""")


def _on_disk(c, keys: list[bytes]) -> set[bytes]:
    return {k for k, r in zip(keys, c.describe(NS, keys)) if r is not None and "disk" in r.tier}


def _drained(c) -> None:
    wait_until(lambda: c.stats().disk.write_queue_blocks == 0, timeout_s=30, what="the disk writer to drain")


@pytest.mark.parametrize("mode", ["commit", "evict"])
def test_kill9_mid_load_serves_exactly_what_the_mode_promises(make_daemon, tmp_path, mode: str) -> None:
    disk_dir = str(tmp_path / "disk")
    P, A, B = _keys("P", 4), _keys("A", 20), _keys("B", 400)
    d = make_daemon(**_opts(disk_dir, mode))
    with d.client() as c:
        c.register_namespace(NS)
        assert c.put_many(NS, P, [_value(k) for k in P]).stored == 4
        assert c.pin(NS, P) == 4
        for i in range(0, 20, 4):
            assert c.put_many(NS, A[i:i + 4], [_value(k) for k in A[i:i + 4]]).stored == 4
            _drained(c)
        before = _on_disk(c, P + A)
        if mode == "commit":
            assert before == set(P + A)           # every block written soon after its commit
        else:
            assert before == set(A[:8])           # RAM holds P + A[8:]: only the 8 it evicted were written
        loader = subprocess.Popen([sys.executable, "-c", _LOAD, d.address], stdout=subprocess.PIPE, text=True)
        assert loader.stdout is not None
        lines = [loader.stdout.readline() for _ in range(4)]
        assert lines[-1].strip() == "running"
        wait_until(lambda: c.stats().counters["disk_writes"] >= len(before) + 6, timeout_s=60,
                   what="the load's blocks on disk")
        confirmed = _on_disk(c, P + A + B)        # had a disk copy before the kill (writes only add to it)
    d.stop(signal.SIGKILL)                        # mid-load: the loader is putting and reading
    loader.kill()
    rest, _ = loader.communicate(timeout=30)
    acknowledged = {k.encode() for line in lines + rest.splitlines() if line.startswith("put ")
                    for k in line.split()[1:]}

    d2 = make_daemon(**_opts(disk_dir, mode))
    with d2.client() as c:
        c.register_namespace(NS)
        back = {r.key for r in c.keys(NS)}
        for k in sorted(back):                    # every block served has exactly its bytes
            assert c.get(NS, k) == _value(k), f"wrong bytes for {k!r} after kill -9"
        assert confirmed <= back <= set(P + A) | acknowledged
        assert before <= back
        if mode == "commit":
            assert set(P + A) <= back
        else:
            assert not back & set(P)              # only in RAM: gone with the daemon
            assert set(A[:8]) <= back
        s = c.stats()
        assert s.disk.checksum_failures == 0 and s.counters["checksum_failures"] == 0


def test_a_clean_stop_under_evict_writes_what_only_ram_held(make_daemon, tmp_path) -> None:
    """SIGTERM, unlike kill -9: the daemon writes RAM's blocks that have no disk copy before it exits, so a
    restart serves the pinned (never evicted, never written) blocks too."""
    disk_dir = str(tmp_path / "disk")
    P, A = _keys("P", 4), _keys("A", 20)
    d = make_daemon(**_opts(disk_dir, "evict"))
    with d.client() as c:
        c.register_namespace(NS)
        assert c.put_many(NS, P, [_value(k) for k in P]).stored == 4
        assert c.pin(NS, P) == 4
        for i in range(0, 20, 4):
            assert c.put_many(NS, A[i:i + 4], [_value(k) for k in A[i:i + 4]]).stored == 4
        assert _on_disk(c, P + A) == set(A[:8])
    d.stop(signal.SIGTERM)
    d2 = make_daemon(**_opts(disk_dir, "evict"))
    with d2.client() as c:
        c.register_namespace(NS)
        assert {r.key for r in c.keys(NS)} == set(P + A)   # everything: the 8 evicted, and the 16 RAM held
        for k in P + A:
            assert c.get(NS, k) == _value(k)
