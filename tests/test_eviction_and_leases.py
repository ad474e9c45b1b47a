"""Eviction under pressure, leases, pins and TTLs against a real daemon.

The daemons here have 16 slabs of 4 MiB and the blocks are 4 MiB, so the arena holds exactly 16 blocks and
every eviction is visible. Watermarks are 1.0 so only pressure (not the background target) evicts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore import StoreFullError
from kvstore.testing import DaemonProcess, wait_until

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC

BLOCK = 4 << 20
NS = "ev/ns"


def _val(i: int) -> bytes:
    return bytes([i % 251]) * 17 + os.urandom(64) + bytes([i % 7]) * (BLOCK - 81)


@pytest.fixture
def full_daemon(make_daemon) -> DaemonProcess:
    return make_daemon(arena_bytes="64MiB", max_block_bytes="4MiB", high_watermark=1.0, low_watermark=1.0,
                       lease_ttl_s=60, reservation_ttl_s=60)


def _keys(r: range) -> list[bytes]:
    return [b"k%02d" % i for i in r]


def test_lru_eviction_order_respects_leases_and_pins(full_daemon: DaemonProcess) -> None:
    with full_daemon.client() as c:
        c.register_namespace(NS)
        values = {k: _val(i) for i, k in enumerate(_keys(range(19)))}
        # put k00..k15 -> arena full (16 slots)
        assert c.put_many(NS, _keys(range(16)), [values[k] for k in _keys(range(16))]).stored == 16
        # lease k00, k01 (held, not released); pin k03; touch k02 -> LRU order now k04, k05, ..., k15, k02
        held = c.lookup(NS, _keys(range(2)))
        assert held.hits == 2
        assert c.pin(NS, [b"k03"]) == 1
        assert c.get(NS, b"k02") == values[b"k02"]
        # put k16..k18 -> evicts k04, k05, k06 exactly
        assert c.put_many(NS, _keys(range(16, 19)), [values[k] for k in _keys(range(16, 19))]).stored == 3
        present = dict(zip(_keys(range(19)), c.exists(NS, _keys(range(19)))))
        assert [k for k, p in present.items() if not p] == [b"k04", b"k05", b"k06"]
        assert c.stats().counters["evictions"] == 3
        # the leased blocks are intact and their generation unchanged
        out = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
        assert c._read(held, out) == [BLOCK, BLOCK]  # noqa: SLF001 - the low-level read path
        assert [o.tobytes() for o in out] == [values[b"k00"], values[b"k01"]]
        c.release([held], wait=True)
        assert c.stats().leases_active == 0


def test_store_full_when_nothing_is_evictable_and_daemon_keeps_serving(full_daemon: DaemonProcess) -> None:
    with full_daemon.client() as c:
        c.register_namespace(NS)
        keys = _keys(range(16))
        c.put_many(NS, keys, [_val(i) for i in range(16)])
        lease = c.lookup(NS, keys[:8])
        assert c.pin(NS, keys[8:]) == 8
        before = c.stats()
        with pytest.raises(StoreFullError, match="store full"):
            c.put(NS, b"new", _val(99))
        after = c.stats()
        assert after.allocated_bytes == before.allocated_bytes  # all or nothing: no slot kept
        assert after.reservations_active == 0
        assert after.counters["store_full"] == 1
        # give one back -> the put succeeds by evicting exactly that block
        assert c.unpin(NS, [keys[8]]) == 1
        assert c.put(NS, b"new", _val(99)) is True
        assert c.exists(NS, [keys[8], b"new"]) == [False, True]
        c.release([lease], wait=True)
        assert c.health().status == "SERVING"


_CHILD = textwrap.dedent("""
    import sys, time
    from kvstore import Client
    c = Client(sys.argv[1])
    keys = [b"k%02d" % i for i in range(4)]
    lease = c.lookup("ev/ns", keys)
    res = c.reserve("ev/ns", [b"r%d" % i for i in range(3)], [4 << 20] * 3)
    print(lease.hits, len(res.reserved_indices), flush=True)
    time.sleep(600)
""")


def test_sigkilled_client_space_returns_after_ttl(make_daemon) -> None:
    d = make_daemon(arena_bytes="64MiB", max_block_bytes="4MiB", high_watermark=1.0, low_watermark=1.0,
                    lease_ttl_s=1.0, reservation_ttl_s=1.0, quarantine_s=0.5)
    with d.client() as c:
        c.register_namespace(NS)
        c.put_many(NS, _keys(range(4)), [_val(i) for i in range(4)])
        baseline = c.stats()
        child = subprocess.Popen([sys.executable, "-c", _CHILD, d.address], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["4", "3"]
        during = c.stats()
        assert (during.leases_active, during.reservations_active) == (1, 1)
        assert during.allocated_bytes == baseline.allocated_bytes + 3 * BLOCK
        assert during.leased_bytes == 4 * BLOCK
        child.send_signal(signal.SIGKILL)
        child.wait()
        wait_until(lambda: (s := c.stats()).leases_active == 0 and s.reservations_active == 0
                   and s.allocated_bytes == baseline.allocated_bytes, timeout_s=10, what="space to come back")
        s = c.stats()
        assert s.counters["lease_expirations"] == 1
        assert s.counters["reservation_expirations"] == 3
        assert s.counters["quarantine_freed"] == 3
        assert s.leased_bytes == 0
        assert c.exists(NS, [b"r0", b"r1", b"r2"]) == [False, False, False]
        # the full arena can be used again: 12 more blocks fit next to the 4 kept ones without eviction
        assert c.put_many(NS, _keys(range(4, 16)), [_val(i) for i in range(4, 16)]).stored == 12
        assert c.stats().counters["evictions"] == 0


def test_copy_that_outlives_its_lease_is_a_miss_not_wrong_bytes(make_daemon) -> None:
    d = make_daemon(arena_bytes="64MiB", max_block_bytes="4MiB", lease_ttl_s=0.5)
    with d.client() as c:
        c.register_namespace(NS)
        c.put(NS, b"old", _val(1))
        stale = c.lookup(NS, [b"old"])
        wait_until(lambda: c.stats().leases_active == 0, timeout_s=10, what="lease expiry")
        assert c.delete(NS, [b"old"]) == 1
        # the freed slot is the lowest free one again: the next block of the same size reuses it
        fresh = c.reserve(NS, [b"new"], [BLOCK])
        assert fresh.offsets[0] == stale.offsets[0]
        new_value = _val(2)
        c._write(fresh, [new_value])  # noqa: SLF001
        c.commit(fresh)
        out = np.zeros(BLOCK, np.uint8)
        assert c._read(stale, [out]) == [None]  # noqa: SLF001 - generation moved: a miss
        assert c.get(NS, b"new") == new_value
