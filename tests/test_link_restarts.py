"""The vLLM connector's link to the daemon across restarts: every request from the moment the daemon serves again
gets what it holds.

The link's three behaviours (connector/link.py), each against a real daemon: a call that met the old connection
of a daemon that answers now is sent again instead of dropped; a save whose spare slots went with their
connection is a lost save, not a paused store; a paused link connects as soon as the daemon's socket accepts,
not retry_s later. And a gRPC call made while a hand-over holds the daemon frozen waits and gets its answer.
"""

from __future__ import annotations

import signal
import threading

from kvstore_connector.link import StoreLink
from kvstore import Client
from kvstore.client.slot_bank import SlotsLostError
from kvstore.errors import StoreUnavailableError
from kvstore.testing import DaemonProcess, wait_until

NS = "m@1/link"
BLOCK = 16 * 1024


def test_a_call_that_met_the_old_connection_is_sent_again_once_the_daemon_answers() -> None:
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB") as d:
        link = StoreLink(d.address, timeout_s=5.0, retry_s=60.0)
        assert link.call(NS, lambda c: c.put(NS, b"k", b"\x01" * BLOCK)) is True
        attempts: list[int] = []

        def meets_old_connection(c: Client) -> list[bool]:
            attempts.append(1)
            if len(attempts) == 1:
                raise StoreUnavailableError("kvstore fast path failed mid-call: connection reset")
            return c.exists(NS, [b"k"])

        assert link.call(NS, meets_old_connection) == [True]
        assert (len(attempts), link.retried, link.failures) == (2, 1, 0)
        assert link.client is not None  # never paused
        link.close()


def test_a_restart_costs_no_request_after_the_daemon_serves(tmp_path) -> None:
    # kill -9 and start again with the disk tier: the first call after the daemon serves gets what it holds
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB", disk_bytes="64MiB",
                      disk_segment_bytes="16MiB", disk_write="commit")  # write-behind: a kill -9 keeps them
    d.start()
    link = StoreLink(d.address, timeout_s=5.0, retry_s=60.0)
    try:
        keys = [b"r-%d" % i for i in range(8)]
        assert link.call(NS, lambda c: c.put_many(NS, keys, [b"\x02" * BLOCK] * 8).stored) == 8
        wait_until(lambda: link.call(NS, lambda c: c.stats().disk.blocks) == 8, 20, what="disk writes")
        d.stop(signal.SIGKILL)
        assert link.call(NS, lambda c: c.lookup_prefix(NS, keys)) is None  # down: the link pauses (retry_s 60)
        d.start()
        # not 60 s later: at the next call, since the socket accepts again
        assert link.call(NS, lambda c: c.lookup_prefix(NS, keys)) == 8
        assert link.call(NS, lambda c: c.get_many(NS, keys)) == [b"\x02" * BLOCK] * 8
    finally:
        link.close()
        d.close()


def test_lost_spare_slots_are_a_lost_save_not_a_paused_store() -> None:
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB") as d:
        link = StoreLink(d.address, timeout_s=5.0, retry_s=60.0)
        c = link.client
        assert c is not None and c.register_namespace(NS) in (True, False)
        bank = c.slot_bank(BLOCK)
        assert bank is not None
        taken = bank.take(2)
        assert taken is not None
        d.stop(signal.SIGKILL)  # the bank's connection and its slots go with the daemon
        d.start()

        def store(cl: Client) -> object:
            return bank.store(NS, [b"s-1", b"s-2"], taken)

        try:
            store(c)
            raise AssertionError("a Store into slots of a dead connection went through")
        except SlotsLostError:
            pass
        assert link.call(NS, store) is None and link.failures == 1
        assert link.client is c  # not paused: the next request goes through
        assert link.call(NS, lambda cl: cl.put(NS, b"after", b"\x03" * BLOCK)) is True
        link.close()


def test_a_grpc_call_during_a_frozen_hand_over_waits_and_is_answered(tmp_path) -> None:
    # the running daemon is held frozen (its gate refuses calls as `restarting`); a call made then is retried by
    # the client; the successor is killed, the daemon resumes, and the call gets its answer
    hold = tmp_path / "held"
    env = {"KVSTORE_HANDOVER_HOLD": "receiver:frozen", "KVSTORE_HANDOVER_HOLD_FILE": str(hold)}
    with DaemonProcess(arena_bytes="32MiB", max_block_bytes="1MiB", handover_timeout_s=30) as d:
        with d.client() as c:
            c.register_namespace(NS)
            assert c.put(NS, b"k", b"\x04" * BLOCK) is True
        s = d.successor(env=env, wait=False)
        wait_until(lambda: hold.exists(), 60, what="the successor held after the freeze")
        got: list[object] = []

        def ask() -> None:  # connecting (Health) and the call itself both meet the closed gate
            with Client(d.address, control="grpc", mode="stream", timeout_s=30) as g:
                got.append(g.exists(NS, [b"k"]))
        t = threading.Thread(target=ask)
        t.start()
        wait_until(lambda: "refused as `restarting`" in d.log(), 20, what="the call refused, in its retry loop")
        assert s.proc is not None
        s.proc.kill()
        s.proc.wait()
        t.join(30)
        assert got == [[True]]
        assert "serving again" in d.log()


def test_a_lease_of_the_restarted_daemon_maps_its_arena_on_first_use(tmp_path) -> None:
    # vLLM's scheduler (a) meets the restarted daemon first and hands its lease to the worker (b), which still maps
    # the old arena: b maps the new one at once, so the first load after a restart is a load, not a recompute
    d = DaemonProcess(workdir=str(tmp_path), arena_bytes="32MiB", max_block_bytes="1MiB")
    d.start()
    try:
        with Client(d.address) as a, Client(d.address) as b:
            a.register_namespace(NS)
            assert a.put(NS, b"k", b"\x05" * BLOCK) is True
            old = b.arena_incarnation
            assert old is not None and b.mode == "arena"
            d.stop(signal.SIGKILL)
            d.start()
            a.register_namespace(NS)
            assert a.put(NS, b"k", b"\x06" * BLOCK) is True
            lease = a.lookup(NS, [b"k"])
            assert lease.hits == 1 and lease.incarnation != old
            m = b.acquire_arena(lease.incarnation)
            assert m is not None and m.incarnation == lease.incarnation == b.arena_incarnation
            m.release()
            a.release([lease])
            assert b.acquire_arena(old) is None  # a lease of the incarnation b left is stale: no mapping, no remap
            assert b.arena_incarnation == lease.incarnation
    finally:
        d.close()
