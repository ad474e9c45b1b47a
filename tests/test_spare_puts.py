"""Puts through spare slots, end to end: a real daemon, real clients, real shared memory.

A fast-path client copies a put's blocks into slots its connection holds ahead (SPARE) and stores them with one
request (STORE). These tests try to break that: the results, bytes and counters must equal a Reserve/Commit
put's; one connection must not store into another's slots; a client killed while holding slots must not leak
them (they wait out the quarantine, then are freed) nor let a new owner's block be overwritten before then; a
daemon killed and restarted under a client holding slots must not fail its next put; another tenant's
namespace stays refused.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client, PutResult, arena_path, spare_puts
from kvstore.errors import ConfigError, InvalidRequestError, KVStoreError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath import spare_bodies as sb
from kvstore.testing import DaemonProcess, wait_until
from tests.fast_helpers import keyset, moved
from tests.tenant_helpers import A_NS, B_NS, tenant_clients

KiB, MiB = 1 << 10, 1 << 20
COUNTED = ("reserve_calls", "reserved_blocks", "committed_blocks", "committed_bytes", "aborted_blocks")


def gauge(d: DaemonProcess, name: str) -> float:
    text = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read().decode()
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[-1])


def allocated(d: DaemonProcess) -> float:
    return gauge(d, 'kvstore_arena_bytes{state="allocated"}')


@pytest.fixture(scope="module")
def daemon():
    with DaemonProcess(arena_bytes="64MiB", quarantine_s=1.0) as d:
        yield d


def test_puts_through_spare_slots_store_what_reserve_and_commit_store(daemon: DaemonProcess) -> None:
    keys = keyset("same", 20)
    blocks = [np.full(64 * KiB, i, np.uint8) for i in range(20)]
    with Client(daemon.address, control="fast") as fast, Client(daemon.address, control="grpc") as plain:
        for c in (fast, plain):
            c.register_namespace(f"sp/{c.control_path}")
        runs = {
            "a batch of 8": lambda c, ns: c.put_many(ns, keys[:8], blocks[:8]),
            "one more": lambda c, ns: c.put(ns, keys[8], blocks[8]),
            "4 present, 4 new": lambda c, ns: c.put_many(ns, keys[4:12], blocks[4:12]),
            "mixed sizes (Reserve)": lambda c, ns: c.put_many(ns, keys[12:14], [blocks[12], blocks[13][:100]]),
        }
        for name, run in runs.items():
            a, da = moved(fast, lambda: run(fast, "sp/fast"), COUNTED)
            b, db = moved(plain, lambda: run(plain, "sp/grpc"), COUNTED)
            assert a == b, name
            assert {**da, "fast_requests": 0} == {**db, "fast_requests": 0}, name
            # the first put of a size asks for slots (Spare) and stores (Store); later ones store only; mixed
            # sizes reserve and commit; Stats adds nothing (no one-way request to settle)
            assert da["fast_requests"] == {"a batch of 8": 2, "one more": 1, "4 present, 4 new": 1,
                                           "mixed sizes (Reserve)": 2}[name], (name, da)
        assert fast.put_many("sp/fast", keys[4:12], blocks[4:12]) == PutResult(0, 8, 0)
        for c in (fast, plain):
            got = plain.get_many(f"sp/{c.control_path}", keys[:14])
            assert got[:12] == [b.tobytes() for b in blocks[:12]] and got[12] == blocks[12].tobytes()
            assert got[13] == blocks[13][:100].tobytes()


def _pool(c: Client, size: int) -> list[int]:
    """The spare slots this thread's connection of `c` holds for blocks of `size` bytes."""
    return c._control.channel.conn().spares.get(size, [])


@pytest.fixture
def parts_of_128k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts of more than 128 KiB go as several Stores (spare_puts.PART_BYTES), so 64 KiB blocks go 2 a Store, as on
    a box with a core left for the daemon while the copy threads run (spare_puts.part_bytes)."""
    monkeypatch.setattr(spare_puts, "PART_BYTES", 128 * KiB)
    monkeypatch.setattr(spare_puts, "_usable_cpus", lambda: 64)


def test_a_put_sent_in_parts_stores_what_one_request_stores(daemon: DaemonProcess, parts_of_128k: None) -> None:
    keys = keyset("parts", 12)
    blocks = [np.full(64 * KiB, 100 + i, np.uint8) for i in range(12)]
    assert spare_puts.parts(7, 64 * KiB) == [(0, 1), (1, 3), (3, 5), (5, 7)]  # as even as can be, 2 at most
    with Client(daemon.address, control="fast") as fast, Client(daemon.address, control="grpc") as plain:
        for c in (fast, plain):
            c.register_namespace(f"pp/{c.control_path}")
        for name, (a, b) in {"8 new": (0, 8), "4 present, 4 new": (4, 12)}.items():
            got, da = moved(fast, lambda: fast.put_many("pp/fast", keys[a:b], blocks[a:b]), COUNTED)
            want, db = moved(plain, lambda: plain.put_many("pp/grpc", keys[a:b], blocks[a:b]), COUNTED)
            assert got == want == PutResult(8 if a == 0 else 4, 0 if a == 0 else 4, 0), name
            # 4 Stores of 2 blocks (the first put also asks for 8 slots): each counts a Reserve and a Commit
            assert da == {**db, "reserve_calls": 4, "fast_requests": 5 if a == 0 else 4}, name
            assert len(_pool(fast, 64 * KiB)) == 8, name  # every slot used was refilled, the present keys' kept
        assert plain.get_many("pp/fast", keys) == [x.tobytes() for x in blocks]


def test_without_a_core_for_the_daemon_a_put_is_one_store(daemon: DaemonProcess,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts pay only where the daemon commits one while the copy threads copy the next on other cores: with as
    many usable CPUs as copy threads, the same put goes as one Store."""
    monkeypatch.setattr(spare_puts, "PART_BYTES", 128 * KiB)
    assert spare_puts.parts(7, 64 * KiB, 0) == [(0, 7)]
    for cpus, threads, want in ((2, 2, 0), (2, 1, 128 * KiB), (3, 2, 128 * KiB), (1, 1, 0)):
        monkeypatch.setattr(spare_puts, "_usable_cpus", lambda cpus=cpus: cpus)
        assert spare_puts.part_bytes(threads) == want, (cpus, threads)
    monkeypatch.setattr(spare_puts, "_usable_cpus", lambda: 2)
    keys = keyset("one-store", 8)
    blocks = [np.full(64 * KiB, 50 + i, np.uint8) for i in range(8)]
    with Client(daemon.address, control="fast", copy_threads=2) as fast:
        fast.register_namespace("one/store")
        got, delta = moved(fast, lambda: fast.put_many("one/store", keys, blocks), COUNTED)
        assert got == PutResult(8, 0, 0)
        # one Store of the 8 blocks (after the request for 8 slots): one Reserve and one Commit of 8
        assert delta == {"reserve_calls": 1, "reserved_blocks": 8, "committed_blocks": 8,
                         "committed_bytes": 8 * 64 * KiB, "aborted_blocks": 0, "fast_requests": 2}
        assert fast.get_many("one/store", keys) == [b.tobytes() for b in blocks]


def test_a_refused_put_in_parts_keeps_every_slot_and_stores_nothing(daemon: DaemonProcess,
                                                                     parts_of_128k: None) -> None:
    keys = keyset("refused-parts", 8)
    blocks = [np.full(64 * KiB, 7, np.uint8)] * 8
    with Client(daemon.address, control="fast") as fast:
        fast.register_namespace("pp/ok")
        assert fast.put_many("pp/ok", keys, blocks).stored == 8
        slots = sorted(_pool(fast, 64 * KiB))
        with pytest.raises(KVStoreError, match="pp/never-registered"):
            fast.put_many("pp/never-registered", keys, blocks)  # each of the 4 Stores refused
        assert sorted(_pool(fast, 64 * KiB)) == slots
        fresh = keyset("refused-parts-after", 8)
        _, delta = moved(fast, lambda: fast.put_many("pp/ok", fresh, blocks), ("reserve_calls",))
        assert delta == {"reserve_calls": 4, "fast_requests": 4}  # the same connection, in step, its slots


def test_a_put_interrupted_between_parts_keeps_the_connection_in_step(daemon: DaemonProcess, parts_of_128k: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the third part copies: the two parts sent are stored and their replies read, the slots of
    the parts not sent stay this connection's, and its next put is answered in order."""
    keys = keyset("interrupted", 8)
    blocks = [np.full(64 * KiB, 9, np.uint8)] * 8
    real, calls = arena_path.SlotWriter.copy, []

    def copy(self: arena_path.SlotWriter, start: int, stop: int) -> None:
        calls.append((start, stop))
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(self, start, stop)
    with Client(daemon.address, control="fast") as fast:
        fast.register_namespace("pp/int")
        assert fast.put_many("pp/int", keyset("interrupted-first", 8), blocks).stored == 8  # holds 8 slots
        monkeypatch.setattr(arena_path.SlotWriter, "copy", copy)
        with pytest.raises(KeyboardInterrupt):
            fast.put_many("pp/int", keys, blocks)
        monkeypatch.setattr(arena_path.SlotWriter, "copy", real)
        assert calls == [(0, 2), (2, 4), (4, 6)]
        assert fast.exists("pp/int", keys) == [True] * 4 + [False] * 4
        assert len(_pool(fast, 64 * KiB)) == 8  # 4 refilled by the 2 Stores, 4 never sent
        res, delta = moved(fast, lambda: fast.put_many("pp/int", keys, blocks), ("reserve_calls",))
        assert res == PutResult(4, 4, 0) and delta == {"reserve_calls": 4, "fast_requests": 4}
        assert fast.get_many("pp/int", keys) == [blocks[0].tobytes()] * 8


def test_a_connection_cannot_store_into_another_connections_slots(daemon: DaemonProcess) -> None:
    with Client(daemon.address, control="fast") as one, Client(daemon.address, control="fast") as other:
        one.register_namespace("sp/own")
        ch1, ch2 = one._control.channel, other._control.channel
        c1 = ch1.conn()
        slot_bytes, slots = sb.decode_spare_reply(ch1.call_on(c1, fp.SPARE, sb.encode_spare(4 * KiB, 2)))
        assert slot_bytes == 4 * KiB and len(slots) == 2
        with pytest.raises(InvalidRequestError, match="not a spare slot of this connection"):
            ch2.call_on(ch2.conn(), fp.STORE, sb.encode_store("sp/own", [b"stolen"], [4 * KiB], slots[:1]))
        assert one.exists("sp/own", [b"stolen"]) == [False]
        stored, outcomes, refill = sb.decode_store_reply(
            ch1.call_on(c1, fp.STORE, sb.encode_store("sp/own", [b"mine"], [4 * KiB], slots[:1])))
        assert (stored, outcomes) == (1, [0]) and refill[0] not in (0, *slots)
        assert one.exists("sp/own", [b"mine"]) == [True]


CHILD = textwrap.dedent("""
    import sys, time, numpy as np
    from kvstore.client import Client
    c = Client(sys.argv[1], control="fast")
    c.register_namespace("sp/killed")
    assert c.put_many("sp/killed", [b"k%d" % i for i in range(4)], [np.full(1 << 20, 5, np.uint8)] * 4).stored == 4
    print("holding", flush=True)   # 4 new spare slots of 1 MiB, refilled after the Store
    slot = c._control.channel.conn().spares[1 << 20][:1]
    with c._spare_writer(c.arena_incarnation, slot, [np.ones(1 << 20, np.uint8)]) as writer:
        while True:                # copies into one of them, over and over, until killed
            writer.copy(0, 1)
""")


def test_a_client_killed_holding_spare_slots_leaks_none() -> None:
    """kill -9 while the client copies into its spare slots: they are not handed to anyone before the
    quarantine is over (a copy may still land), and are freed after it."""
    with DaemonProcess(arena_bytes="64MiB", quarantine_s=1.0) as daemon:
        base = allocated(daemon)
        child = subprocess.Popen([sys.executable, "-c", CHILD, daemon.address], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "holding"
            assert allocated(daemon) == base + 8 * MiB  # 4 blocks stored + 4 spare slots
            assert (gauge(daemon, "kvstore_spare_slots"), gauge(daemon, "kvstore_spare_bytes")) == (4, 4 * MiB)
            child.send_signal(signal.SIGKILL)
            child.wait(10)
        finally:
            child.kill()
        time.sleep(0.3)
        assert allocated(daemon) == base + 8 * MiB  # quarantined (quarantine_s = 1)
        assert (gauge(daemon, "kvstore_spare_slots"), gauge(daemon, "kvstore_spare_bytes")) == (0, 4 * MiB)
        with Client(daemon.address) as c:
            wait_until(lambda: allocated(daemon) == base + 4 * MiB, timeout_s=10,
                       what="the killed client's spare slots to be freed after the quarantine")
            assert gauge(daemon, "kvstore_spare_bytes") == 0
            assert c.get_many("sp/killed", [b"k%d" % i for i in range(4)]) == [bytes([5]) * MiB] * 4


def test_a_daemon_restarted_under_a_client_holding_spare_slots(tmp_path: Path) -> None:
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="64MiB")
    d.start()
    try:
        c = Client(d.address, control="fast")
        c.register_namespace("sp/r")
        assert c.put("sp/r", b"before", b"b" * 4096)
        assert c._control.channel.conn().spares[4096]  # holds a slot for the next put
        d.stop(signal.SIGKILL)
        d.start()
        c.register_namespace("sp/r")
        assert c.put("sp/r", b"after", b"a" * 4096)  # the old connection and its slots are gone: no error
        assert c.get_many("sp/r", [b"before", b"after"]) == [None, b"a" * 4096]
        assert c.put("sp/r", b"again", b"g" * 4096) and c.get("sp/r", b"again") == b"g" * 4096
        c.close()
    finally:
        d.close()


def test_a_tenants_connection_stores_into_its_own_namespaces_only(tmp_path: Path) -> None:
    with tenant_clients(tmp_path, control="fast") as (_, alice, bob):
        assert alice.put(A_NS, b"k", b"a" * 4096) and bob.put(B_NS, b"k", b"b" * 4096)
        with pytest.raises(KVStoreError) as refused:
            bob.put(A_NS, b"x", b"x" * 4096)   # through bob's spare slots: the daemon refuses her namespace
        with pytest.raises(type(refused.value)):
            bob.reserve(A_NS, [b"x"], [4096])
        assert alice.get(A_NS, b"k") == b"a" * 4096 and bob.get(B_NS, b"k") == b"b" * 4096
        assert alice.exists(A_NS, [b"x"]) == [False]
        assert bob.put(B_NS, b"y", b"y" * 4096)  # his slots are still his after the refusal


def test_spare_slots_can_be_turned_off_and_a_bad_setting_says_how(daemon: DaemonProcess,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_SPARE_SLOTS", "yes")
    with pytest.raises(ConfigError, match="KVSTORE_SPARE_SLOTS='yes': use 1"):
        Client(daemon.address, control="fast")
    monkeypatch.setenv("KVSTORE_SPARE_SLOTS", "0")
    with Client(daemon.address, control="fast") as off, \
            Client(daemon.address, control="fast", spare_slots=False) as off_too:
        off.register_namespace("sp/off")
        for c, key in ((off, b"a"), (off_too, b"b")):
            assert c.put("sp/off", key, b"x" * 4096)
            _, delta = moved(c, lambda: c.put("sp/off", key + b"2", b"y" * 4096), ("reserve_calls",))
            assert delta == {"reserve_calls": 1, "fast_requests": 2}  # Reserve and Commit: no Spare, no Store
            assert c._control.channel.conn().spares == {}
