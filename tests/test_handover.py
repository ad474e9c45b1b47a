"""A hand-over restart between two real daemon processes: every RAM block, lease, reservation and session carries
over, connected clients keep their mappings and ride through, nothing is copied.

Each test starts a daemon, gives it state through real clients, starts `kvstore-server --take-over` beside it
(DaemonProcess.successor), and checks what the successor serves and what the clients saw, exactly.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

import pytest

from kvstore import Client
from kvstore.errors import KVStoreError
from kvstore.testing import DaemonProcess, wait_until
from kvstore.vocab import Tier

NS = "m@1/handover"
BLOCK = 64 * 1024


def _value(i: int) -> bytes:
    return i.to_bytes(4, "little") * (BLOCK // 4)


def _fill(c: Client, n: int, ns: str = NS, first: int = 0) -> tuple[list[bytes], list[bytes]]:
    c.register_namespace(ns)
    keys = [b"key-%05d" % i for i in range(first, first + n)]
    values = [_value(i) for i in range(first, first + n)]
    assert c.put_many(ns, keys, values).stored == n
    return keys, values


def _pid(c: Client) -> int:
    return c.health().pid


def test_every_block_lease_reservation_and_session_carries_over_and_clients_keep_their_mapping() -> None:
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="1MiB") as d:
        c = d.client()
        keys, values = _fill(c, 200)
        assert c.mode == "arena" and c.control_path == "fast" and c.probe_path == "index"
        incarnation, span, old_pid = c.arena_incarnation, c.arena_span, _pid(c)
        lease = c.lookup(NS, keys[:4])                        # a load in flight over the hand-over
        res = c.reserve(NS, [b"late"], [BLOCK])               # a save in flight
        m = c.acquire_arena(res.incarnation)
        assert m is not None
        with m:
            ctypes.memset(m.address + res.offsets[0], 0x5A, BLOCK)
        c.note_session(NS, "agent-1", keys[:10])
        s = d.successor()
        try:
            assert d.proc is not None and d.proc.returncode == 0  # the old process exited by itself
            assert _pid(c) == s.proc.pid != old_pid
            # same incarnation, same mapping: nothing to remap, nothing copied
            assert c.arena_incarnation == incarnation and c.arena_span == span
            assert c.get_many(NS, keys) == values
            assert c.lease_valid(lease) == [True] * 4
            c.release([lease], wait=True)
            assert c.commit(res) == 1
            assert c.get(NS, b"late") == b"\x5a" * BLOCK
            assert c.probe_path == "index" and c.lookup_prefix(NS, keys) == 200
            assert [e.keys for e in c.explain_session("agent-1")] == [tuple(keys[:10])]
            wait_until(lambda: c.stats().leases_active == 0, 10, what="background releases")  # gets release late
            st = c.stats()
            assert (st.blocks, st.leases_active, st.reservations_active) == (201, 0, 0)
            with s.client() as fresh:
                assert fresh.get_many(NS, keys) == values
                assert fresh.probe_prefix_tiers([NS], keys)[1] == [int(Tier.RAM)] * 200
        finally:
            c.close()
            s.close()


def test_requests_in_flight_across_the_hand_over_all_finish() -> None:
    # a writer, a reader and a gRPC-control client run through the hand-over: no call fails, no byte is wrong
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="1MiB") as d:
        with d.client() as c:
            keys, values = _fill(c, 64)
        stop = threading.Event()
        errors: list[BaseException] = []
        done = {"reads": 0, "writes": 0, "grpc": 0}

        def reader() -> None:
            with d.client() as r:
                while not stop.is_set():
                    got = r.get_many(NS, keys)
                    if got != values:
                        errors.append(AssertionError("a read returned other bytes"))
                    done["reads"] += 1

        def writer() -> None:  # 100 keys written over and over (deleted first): the arena never evicts
            with d.client() as w:
                i = 0
                while not stop.is_set():
                    key = b"w-%d" % (i % 100)
                    if i >= 100:
                        assert w.delete(NS, [key]) == 1
                    assert w.put(NS, key, _value(1000 + i % 100)) is True
                    i += 1
                    done["writes"] += 1

        def grpc_client() -> None:
            with d.client(control="grpc", mode="stream") as g:
                while not stop.is_set():
                    assert g.exists(NS, keys[:8]) == [True] * 8
                    done["grpc"] += 1

        def guard(fn):
            def run() -> None:
                try:
                    fn()
                except (KVStoreError, AssertionError) as exc:
                    errors.append(exc)
            return run

        threads = [threading.Thread(target=guard(f)) for f in (reader, writer, grpc_client)]
        for t in threads:
            t.start()
        wait_until(lambda: min(done.values()) >= 3, 30, what="clients running")
        before = dict(done)
        s = d.successor()
        try:
            wait_until(lambda: all(done[k] >= before[k] + 3 for k in done), 30, what="clients through the hand-over")
            stop.set()
            for t in threads:
                t.join(30)
            assert errors == [], (errors, d.log()[-3000:], s.log()[-3000:])
            with s.client() as c:
                assert c.get_many(NS, keys) == values
                n = min(100, done["writes"])
                got = c.get_many(NS, [b"w-%d" % i for i in range(n)])
                assert got == [_value(1000 + i) for i in range(n)]  # every acknowledged write is there
        finally:
            stop.set()
            s.close()


def test_sigusr2_starts_the_successor_itself() -> None:
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB") as d:
        c = d.client()
        keys, values = _fill(c, 20)
        old = _pid(c)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGUSR2)
        wait_until(lambda: d.proc is not None and d.proc.poll() is not None, 60, what="the old daemon's exit")
        assert d.proc.returncode == 0
        wait_until(lambda: _pid(c) != old, 30, what="the successor answering")
        new = _pid(c)
        assert c.get_many(NS, keys) == values
        c.close()
        os.kill(new, signal.SIGTERM)
        wait_until(lambda: not os.path.exists(f"/proc/{new}"), 30, what="the successor's exit")


def test_tenants_files_carry_over_and_stay_apart(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-0123456789\nbob bob-token-0123456789abc\n")
    tokens.chmod(0o600)
    for who in ("alice", "bob"):
        (tmp_path / who).write_text(f"{who}-token-0123456789" + ("abc" if who == "bob" else "") + "\n")
        (tmp_path / who).chmod(0o600)
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB", tokens_file=str(tokens)) as d:
        a = d.client(token_file=str(tmp_path / "alice"))
        b = d.client(token_file=str(tmp_path / "bob"))
        ka, va = _fill(a, 10, ns="a@1/x")
        kb, vb = _fill(b, 10, ns="b@1/x")
        s = d.successor()
        try:
            assert a.get_many("a@1/x", ka) == va and b.get_many("b@1/x", kb) == vb
            with pytest.raises(KVStoreError):
                b.get_many("a@1/x", ka)  # still another tenant's: unknown to bob
        finally:
            a.close()
            b.close()
            s.close()


def test_the_disk_tier_carries_on_and_ram_hits_stay_in_ram(tmp_path) -> None:
    with DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB",
                       disk_bytes="256MiB", disk_segment_bytes="16MiB", disk_write="commit") as d:
        c = d.client()
        keys, values = _fill(c, 40)
        s = d.successor()
        try:
            assert c.probe_prefix_tiers([NS], keys)[1] == [int(Tier.RAM)] * 40
            more, mvalues = _fill(c, 10, first=100)
            wait_until(lambda: c.stats().disk.blocks == 50, 30, what="the successor's disk writes")
            assert c.get_many(NS, keys + more) == values + mvalues
        finally:
            c.close()
            s.close()


def test_with_handover_linger_the_old_process_waits_for_sigterm_holding_nothing() -> None:
    # a Kubernetes DaemonSet restarts a container that exits: the old daemon stays, serving nothing, and the
    # successor still gets every port (metrics, hand-over socket) once the old one let go of them
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB", handover_linger=True) as d:
        c = d.client()
        keys, values = _fill(c, 10)
        s = d.successor(wait=False)
        assert d.proc is not None and s.proc is not None
        wait_until(lambda: "waiting for SIGTERM (handover_linger)" in d.log(), 60, what="the old daemon lingering")
        s._wait_ready(30)  # noqa: SLF001
        try:
            assert d.proc.poll() is None and _pid(c) == s.proc.pid
            assert c.get_many(NS, keys) == values
            wait_until(lambda: "metrics on" in s.log(), 20, what="the successor's metrics port")
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(30) == 0
            s2 = s.successor(wait=False)  # the successor took the hand-over socket too: it can hand over in turn
            wait_until(lambda: "waiting for SIGTERM (handover_linger)" in s.log(), 60, what="the first successor")
            s2._wait_ready(30)  # noqa: SLF001
            assert _pid(c) == s2.proc.pid and c.get_many(NS, keys) == values  # type: ignore[union-attr]
            s2.close()
        finally:
            c.close()
            s.close()
