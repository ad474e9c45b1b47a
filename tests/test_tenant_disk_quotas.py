"""Per-tenant disk quotas through a real daemon with tokens: bob's burst through the disk tier cannot evict
alice below her quota, before or after a restart, and Stats / metrics / config say what the quotas are.

Shapes: 1 MiB blocks, 4 MiB arena (RAM has no quota here, so bob's puts push alice out of RAM), disk of 8
segments of 1 MiB (one block each), alice guaranteed 2 MiB of disk. Puts go 2 blocks at a time and wait for
the write-behind, so the log's order is the put order and the counts below are exact (see each comment).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client, ConfigError
from kvstore.client.types import TenantInfo
from kvstore.server.config import load_config
from kvstore.testing import DaemonProcess, wait_until
from tests.tenant_helpers import A_NS, ALICE_TOKEN, B_NS, BOB_TOKEN, secret

MIB = 1 << 20


def _value(ns: str, i: int) -> bytes:
    seed = int.from_bytes(hashlib.sha256(f"{ns}/{i}".encode()).digest()[:8], "little")
    return random.Random(seed).randbytes(MIB)


def _put_through(c: Client, ns: str, first: int, n: int) -> None:
    """Put 2 blocks at a time, each pair on disk before the next (the log's order is the put order)."""
    for i in range(first, first + n, 2):
        keys = [b"k%d" % j for j in range(i, min(i + 2, first + n))]
        assert c.put_many(ns, keys, [_value(ns, int(k[1:])) for k in keys]).stored == len(keys)
        wait_until(lambda: all(r is not None and "disk" in r.tier for r in c.describe(ns, keys)), timeout_s=30,
                   what="the blocks on disk")


def _cli(d: DaemonProcess, token_file: str, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "--address", d.address, "--token-file", token_file,
                        *args], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    return r.stdout


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def files(tmp_path):
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    return (tokens, secret(str(tmp_path / "alice.token"), ALICE_TOKEN),
            secret(str(tmp_path / "bob.token"), BOB_TOKEN), str(work))


def _daemon(tokens: str, work: str) -> DaemonProcess:
    return DaemonProcess(workdir=work, tokens_file=tokens, arena_bytes="4MiB", max_block_bytes="1MiB",
                         high_watermark=1.0, low_watermark=1.0, disk_bytes="8MiB", disk_segment_bytes="1MiB",
                         disk_sync="none", disk_reinsert_hits=0, tenant_disk_quota="alice=2MiB",
                         disk_write="commit",  # every put reaches the disk: the burst fills it
                         metrics_namespace_labels="name")  # tenant names as labels: checked below


def test_a_burst_through_the_disk_tier_keeps_the_other_tenants_quota(files) -> None:
    tokens, alice_file, bob_file, work = files
    d = _daemon(tokens, work)
    try:
        d.start()
        with Client(d.address, token_file=alice_file) as alice, Client(d.address, token_file=bob_file) as bob:
            alice.register_namespace(A_NS)
            bob.register_namespace(B_NS)
            _put_through(alice, A_NS, 0, 2)       # segments 0-1
            _put_through(bob, B_NS, 0, 20)        # b0-b5 fill 2-7; from b6 on every 6 blocks pass the log once
            # each pass copies alice's 2 blocks forward (3 passes: b6, b12, b18); bob keeps his newest 6
            st = bob.stats()
            assert (st.disk.blocks, st.disk.evicted_blocks) == (8, 14)
            assert st.tenants == [TenantInfo("bob", 4 * MIB, 0, 6 * MIB, 0)]   # a token sees its own row
            assert [n.disk_bytes for n in st.namespaces] == [6 * MIB]
            assert alice.stats().tenants == [TenantInfo("alice", 0, 0, 2 * MIB, 2 * MIB)]
            m = _scrape(d.metrics_url)
            assert m[("kvstore_disk_quota_kept_blocks_total", ())] == 6
            assert m[("kvstore_tenant_bytes", (("tenant", "alice"), ("tier", "disk")))] == 2 * MIB
            assert m[("kvstore_tenant_quota_bytes", (("tenant", "alice"), ("tier", "disk")))] == 2 * MIB
            assert m[("kvstore_tenant_bytes", (("tenant", "bob"), ("tier", "disk")))] == 6 * MIB
            doc = json.loads(_cli(d, alice_file, "--json", "stats"))
            assert doc["tenants"] == [{"tenant": "alice", "ram_bytes": 0, "ram_quota_bytes": 0,
                                       "disk_bytes": 2 * MIB, "disk_quota_bytes": 2 * MIB}]
            rows = [[c.strip() for c in line.split("│")[1:-1]] for line in _cli(d, alice_file, "stats").splitlines()]
            assert ["alice", "0 B", "-", "2.0 MiB", "2.0 MiB"] in rows   # the tenants table
            assert alice.get_many(A_NS, [b"k0", b"k1"]) == [_value(A_NS, 0), _value(A_NS, 1)]  # from disk
            assert bob.exists(B_NS, [b"k%d" % i for i in range(20)]) == [False] * 14 + [True] * 6
        d.stop()
        d._log.close()
        d.start()   # owners come back from <disk_dir>.owners.json: the quota holds before alice registers again
        with Client(d.address, token_file=bob_file) as bob:
            bob.register_namespace(B_NS)
            _put_through(bob, B_NS, 20, 12)
            assert bob.stats().disk.blocks == 8
        with Client(d.address, token_file=alice_file) as alice:
            assert alice.stats().tenants == [TenantInfo("alice", 0, 0, 2 * MIB, 2 * MIB)]
            alice.register_namespace(A_NS)
            assert alice.get_many(A_NS, [b"k0", b"k1"]) == [_value(A_NS, 0), _value(A_NS, 1)]
    finally:
        d.close()


def test_disk_quotas_are_validated(tmp_path) -> None:
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\ncarol carol-0123456789abcd\n")
    base = ["--disk-bytes", "8MiB", "--disk-segment-bytes", "1MiB", "--max-block-bytes", "1MiB", "--tokens-file", tokens]
    load_config(base + ["--tenant-disk-quota", "alice=4MiB,*=1MiB"])   # 4 + 2 x 1 = 6 MiB = 8 - 2 segments
    with pytest.raises(ConfigError, match=r"guarantees 7340032 bytes .*for 2 tenant.*can protect: 6291456 bytes"):
        load_config(base + ["--tenant-disk-quota", "alice=5MiB,*=1MiB"])
    with pytest.raises(ConfigError, match="needs the disk tier"):
        load_config(["--disk-bytes", "0", "--tenant-disk-quota", "alice=1MiB"])
    with pytest.raises(ConfigError, match="tenant_disk_quota: cannot read 'alice'"):
        load_config(base + ["--tenant-disk-quota", "alice"])
