"""Gets answered from the shared key index, end to end: a real daemon, real clients, the real arena.

When the client's key index holds every key of a get, the get takes no lease and makes no round trip: it reads
offsets, sizes and generations from the table, copies, checks the generations, and tells the daemon one way
(HITS with HITS_READ). These tests try to break that: the answers and counters must equal a leased get's; a
get must still answer with the daemon stopped; a slot reclaimed during the copy must be read again under a
lease, never handed over; a writer reusing slots under a reader must never make a get return another key's
bytes; a restarted daemon's keys must never come from the dead one's arena; another tenant's client gets
nothing of the first tenant's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.testing import DaemonProcess, wait_until
from tests.fast_helpers import churning, counting, keyset, moved
from tests.tenant_helpers import A_NS, B_NS, tenant_clients

COUNTED = ("lookup_calls", "lookup_keys", "hit_keys", "hit_keys_ram", "hit_bytes_ram")
SIZE = 4096


def value(i: int) -> bytes:
    return bytes([i % 251 + 1]) * SIZE


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(arena_bytes="64MiB") as d:
        yield d


def test_a_get_of_indexed_keys_answers_and_counts_as_a_leased_get(daemon: DaemonProcess) -> None:
    keys = keyset("get", 12)
    with Client(daemon.address, control="fast") as fast, Client(daemon.address, control="grpc") as leased:
        fast.register_namespace("g/ns")
        assert fast.put_many("g/ns", keys[:10], [value(i) for i in range(10)]).stored == 10
        assert fast.probe_path == "index"
        for chain in (keys[:10], keys[3:4], keys):  # all indexed, one key, and two never stored
            a, da = moved(fast, lambda: fast.get_many("g/ns", chain), COUNTED)
            b, db = moved(leased, lambda: leased.get_many("g/ns", chain), COUNTED)
            assert a == b == [value(i) if i < 10 else None for i in range(len(keys)) if keys[i] in chain]
            assert {**da, "fast_requests": 0} == {**db, "fast_requests": 0}
            assert da["hit_bytes_ram"] == SIZE * min(len(chain), 10)
            # all indexed: the one-way HITS then Stats' settling Echo; else a leased Lookup (and its Release, on
            # the background thread: counted or not yet by the time Stats reads)
            assert da["fast_requests"] in ((2,) if chain != keys else (1, 2)), (len(chain), da)
        buffers = [np.zeros(SIZE, np.uint8) for _ in range(10)]
        sizes, delta = moved(fast, lambda: fast.get_many_into("g/ns", keys[:10], buffers), COUNTED)
        assert sizes == [SIZE] * 10 and [bytes(b) for b in buffers] == [value(i) for i in range(10)]
        assert (delta["lookup_calls"], delta["lookup_keys"], delta["fast_requests"]) == (1, 10, 2)
        assert fast.stats().leases_active == 0
        small = np.zeros(SIZE - 1, np.uint8)
        with pytest.raises(KVStoreError, match="holds 4095 bytes but the block has 4096"):
            fast.get_into("g/ns", keys[0], small)  # the same refusal as a leased get's


def test_a_get_from_the_index_answers_with_the_daemon_stopped(daemon: DaemonProcess) -> None:
    """No round trip: with the daemon SIGSTOPped a get of indexed keys still returns their bytes; its effects
    (one Lookup of 8 keys, their bytes) are counted once the daemon runs again."""
    keys = keyset("stopped", 8)
    with Client(daemon.address, control="fast") as c:
        c.register_namespace("g/stop")
        c.put_many("g/stop", keys, [value(i) for i in range(8)])
        assert c.get("g/stop", keys[0]) == value(0)  # fetches the table
        before = c.stats()
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            got = c.get_many("g/stop", keys)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert got == [value(i) for i in range(8)]
        after = c.stats()
        assert after.counters["lookup_calls"] - before.counters["lookup_calls"] == 1
        assert after.counters["hit_bytes_ram"] - before.counters["hit_bytes_ram"] == 8 * SIZE
        assert after.leases_active == 0


def test_a_slot_reclaimed_during_the_copy_is_read_again_under_a_lease(daemon: DaemonProcess) -> None:
    """The table's answer for key 2 carries a generation the slot no longer has (what a reader sees when the
    block was evicted and its slot reused while it copied): that copy is dropped and key 2 alone is read again
    with a lease; every returned byte is right."""
    keys = keyset("reclaimed", 5)
    with Client(daemon.address, control="fast") as c:
        c.register_namespace("g/gen")
        c.put_many("g/gen", keys, [value(i) for i in range(5)])
        real = c._control.lookup_here

        def stale(namespace: str, ks: list[bytes]):  # type: ignore[no-untyped-def]
            got = real(namespace, ks)
            assert got is not None
            gens = list(got.generations)
            gens[2] += 1
            return dataclasses.replace(got, generations=gens)
        c._control.lookup_here = stale
        buffers = [np.zeros(SIZE, np.uint8) for _ in range(5)]
        sizes, delta = moved(c, lambda: c.get_many_into("g/gen", keys, buffers), COUNTED)
        assert sizes == [SIZE] * 5 and [bytes(b) for b in buffers] == [value(i) for i in range(5)]
        # the HITS of 5 keys, then a leased Lookup of key 2 alone
        assert (delta["lookup_calls"], delta["lookup_keys"], delta["hit_bytes_ram"]) == (2, 6, 6 * SIZE)
        assert c.get_many("g/gen", keys) == [value(i) for i in range(5)]


def test_a_writer_reusing_slots_never_makes_a_get_return_another_keys_bytes(daemon: DaemonProcess) -> None:
    """A writer deletes and stores half the keys over and over (their slots go to other keys) while a reader
    gets every key from the index: each answer is the key's own bytes or a miss, never another block's."""
    keys = keyset("churn", 16)
    own = {k: value(i) for i, k in enumerate(keys)}
    with Client(daemon.address, control="fast") as c:
        c.register_namespace("g/churn")
        c.put_many("g/churn", keys, [own[k] for k in keys])
        here = counting(c._control, "lookup_here")
        right = missed = 0
        buf = np.zeros(SIZE, np.uint8)
        with churning(daemon, "g/churn", keys, own.__getitem__):
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                for k in keys:
                    if c.get_into("g/churn", k, buf) is None:
                        missed += 1
                        continue
                    assert bytes(buf) == own[k]
                    right += 1
        assert right > 100 and sum(here) > 100, (right, missed, sum(here), len(here))
        print(f"\n{right} gets checked, {missed} misses, {sum(here)} of {len(here)} answered from the index")


def test_a_restarted_daemons_keys_never_come_from_the_dead_ones_arena(tmp_path: Path) -> None:
    keys = keyset("restart", 6)
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="64MiB")
    d.start()
    try:
        c = Client(d.address, control="fast")
        c.register_namespace("g/r")
        c.put_many("g/r", keys, [value(i) for i in range(6)])
        assert c.get_many("g/r", keys) == [value(i) for i in range(6)]
        old = c._control.index.view()
        d.stop(signal.SIGKILL)
        assert old.probe("g/r", keys)[0] == 6  # the dead daemon's table still says "held"
        with pytest.raises(KVStoreError):
            c.get_many("g/r", keys)            # the daemon is gone: an error, not the old arena's bytes
        d.start()
        c.register_namespace("g/r")
        assert c.get_many("g/r", keys) == [None] * 6
        c.put_many("g/r", keys[:2], [value(40), value(41)])
        assert c.get_many("g/r", keys[:2]) == [value(40), value(41)]
        assert c._control.index.view() is not old
        c.close()
    finally:
        d.close()


def test_another_tenants_client_gets_none_of_the_first_tenants_bytes(tmp_path: Path) -> None:
    keys = keyset("tenants", 6)
    with tenant_clients(tmp_path, control="fast") as (_, alice, bob):
        alice.put_many(A_NS, keys, [b"a" * SIZE] * 6)
        bob.put_many(B_NS, keys[:2], [b"b" * SIZE] * 2)
        assert alice.get_many(A_NS, keys) == [b"a" * SIZE] * 6
        assert bob.get_many(B_NS, keys) == [b"b" * SIZE] * 2 + [None] * 4  # the same keys: his own bytes
        with pytest.raises(KVStoreError) as refused:
            bob.get_many(A_NS, keys)            # not in his table: the daemon refuses him her namespace
        with pytest.raises(type(refused.value)):
            bob.lookup(A_NS, keys)
        # bob's get of B_NS missed 4 keys, so it leased: its Release goes out on his background thread
        wait_until(lambda: alice.stats().leases_active == 0, timeout_s=10, what="bob's background Release")
