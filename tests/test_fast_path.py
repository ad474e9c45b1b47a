"""The daemon's same-node socket (kvstore/server/fast_server.py) against a real daemon: the arena handoff, the
fast control path, and bad input. Raw sockets read exact frames: header (length, op, flags, status, request id),
body, and any descriptor that came with it.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from kvstore import Client
from kvstore.client.fast_channel import request_arena
from kvstore.errors import (InvalidRequestError, StoreUnavailableError, UnauthenticatedError,
                            UnknownNamespaceError, UnknownReservationError)
from kvstore.fastpath import protocol as fp
from kvstore.testing import DaemonProcess, wait_until
from tests.tenant_helpers import A_NS, ALICE_TOKEN, B_NS, BOB_TOKEN, secret


class Raw:
    """A hand-driven connection: send frames, read exact replies."""

    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)

    def send(self, data: bytes) -> None:
        self.s.sendall(data)

    def reply(self) -> tuple[fp.Header, bytes, int]:
        data, fds, _, _ = socket.recv_fds(self.s, fp.HEADER.size, 4)
        for fd in fds:
            os.close(fd)
        if not data:
            raise EOFError
        while len(data) < fp.HEADER.size:
            data += self.s.recv(fp.HEADER.size - len(data))
        head = fp.Header.parse(data)
        body = b""
        while len(body) < head.length:
            body += self.s.recv(head.length - len(body))
        return head, body, len(fds)

    def hello(self, token: str = "", want_arena: bool = False) -> tuple[fp.Header, bytes, int]:
        self.send(fp.frame(fp.HELLO, fp.encode_hello(token, want_arena), 1))
        return self.reply()

    def closed(self) -> bool:
        try:
            return self.s.recv(1) == b""
        except OSError:
            return True

    def close(self) -> None:
        self.s.close()


def _error(head: fp.Header, body: bytes) -> tuple[str, str, bool]:
    assert head.status == fp.ERROR
    reason, message = fp.decode_error(body)
    return reason, message, bool(head.flags & fp.CLOSING)


def test_hello_hands_the_shared_arena_without_tokens_and_the_client_uses_the_fast_path() -> None:
    with DaemonProcess() as d:
        path = d.socket_path + ".arena"
        r = Raw(path)
        head, body, fds = r.hello("", want_arena=True)
        assert (head.status, fds) == (fp.OK, 1) and fp.decode_hello_reply(body)[1] == 4096
        head, body, fds = r.hello("anything-here-at-all")  # a second HELLO on an open connection
        assert _error(head, body) == ("invalid_request", "bad Hello frame: HELLO again on an open connection", True)
        r.close()
        with Client(d.tcp_address) as c:     # a TCP client on the same host is told where the socket is
            assert (c.mode, c.control_path) == ("arena", "fast")
            c.register_namespace("h/ns")
            assert c.put("h/ns", b"k", b"z" * 5000) and c.get("h/ns", b"k") == b"z" * 5000
        with Client(d.address, control="grpc") as c:
            assert (c.mode, c.control_path) == ("arena", "grpc") and c.get("h/ns", b"k") == b"z" * 5000


def test_bad_hellos_are_refused_with_a_reason_and_no_descriptor(tmp_path: Path) -> None:
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\n")
    with DaemonProcess(tokens_file=tokens) as d:
        path = d.socket_path + ".arena"

        def hello_raw(payload: bytes) -> tuple[str, str, bool, int]:
            r = Raw(path)
            r.send(payload)
            head, body, fds = r.reply()
            reason, msg, closing = _error(head, body)
            assert r.closed()
            return reason, msg, closing, fds

        bad_magic = struct.pack("<4sHBBI", b"GET ", 1, 1, 0, 0)
        assert hello_raw(fp.frame(fp.HELLO, bad_magic)) == (
            "invalid_request", "not a kvstore fast-path hello (bad magic)", True, 0)
        assert hello_raw(fp.frame(fp.HELLO, struct.pack("<4sHBBI", b"KVFP", 1, 1, 0, 1 << 30))) == (
            "invalid_request", "token of 1073741824 bytes is longer than 4096", True, 0)
        assert hello_raw(fp.frame(fp.ECHO, b"")) == ("invalid_request", "the first frame must be HELLO", True, 0)
        assert hello_raw(fp.frame(fp.HELLO, fp.encode_hello("", True))) == (
            "unauthenticated", "missing bearer token", True, 0)
        assert hello_raw(fp.frame(fp.HELLO, fp.encode_hello("x" * 20, True))) == (
            "unauthenticated", "invalid bearer token (not in the daemon's tokens_file)", True, 0)
        assert hello_raw(struct.pack("<IBBHI", 1 << 30, fp.HELLO, 0, 0, 1)) == (
            "invalid_request", f"frame body of {1 << 30} bytes exceeds {fp.MAX_BODY}", True, 0)
        with pytest.raises(UnauthenticatedError, match="invalid bearer token"):
            request_arena(path, "y" * 20)
        with pytest.raises(UnauthenticatedError):
            Client(d.address, token_file=secret(str(tmp_path / "wrong"), "z" * 20), control="fast")
        # a client that connects and stalls is cut at the HELLO deadline and blocks nobody meanwhile
        stalled = Raw(path)
        stalled.send(b"\x05\x00")                 # two bytes of a header, then nothing
        t0 = time.monotonic()
        fd, _ = request_arena(path, ALICE_TOKEN)
        os.close(fd)
        assert time.monotonic() - t0 < 1.0
        assert stalled.closed() and time.monotonic() - t0 < 5.0
        assert d.proc.poll() is None and "refused a fast-path connection: missing bearer token" in d.log()


def test_pipelined_requests_are_answered_in_order_with_their_ids() -> None:
    with DaemonProcess() as d, d.client() as c:
        c.register_namespace("p/ns")
        c.put_many("p/ns", [b"a", b"b"], [b"1" * 4096, b"2" * 8192])
        r = Raw(d.socket_path + ".arena")
        assert r.hello()[0].status == fp.OK
        frames = [fp.frame(fp.EXISTS, fp.encode_exists("p/ns", [b"a", b"x", b"b"]), 7),
                  fp.frame(fp.LOOKUP, fp.encode_lookup("p/ns", [b"b", b"a"]), 8, flags=fp.LOOKUP_LEASE),
                  fp.frame(fp.ECHO, b"ping", 9),
                  fp.frame(fp.LOOKUP, fp.encode_lookup("p/nope", [b"a"]), 10)]
        r.send(b"".join(frames))                    # all four before reading anything
        replies = [r.reply() for _ in frames]
        assert [h.request_id for h, _, _ in replies] == [7, 8, 9, 10]
        assert fp.decode_bools(replies[0][1]) == [True, False, True]
        lk = fp.decode_lookup_reply(replies[1][1])
        assert (lk.present, lk.sizes, lk.tiers) == ([True, True], [8192, 4096], [1, 1]) and lk.lease_id > 0
        assert replies[2][1] == b"ping"
        assert _error(replies[3][0], replies[3][1]) == (
            "unknown_namespace", "unknown namespace 'p/nope': register it first (RegisterNamespace)", False)
        r.send(fp.frame(fp.RELEASE, fp.encode_release([lk.lease_id]), 11))   # the connection is still good
        head, body, _ = r.reply()
        assert (head.request_id, fp.decode_count(body)) == (11, 1)
        r.close()


def test_replies_held_for_pipelined_requests_leave_in_order_before_an_error_and_never_wait_for_a_split_frame(
        ) -> None:
    """The daemon holds a reply while the next request is already buffered and sends them together: the held
    replies must still come, in order, before the closing error of a malformed frame behind them, and a request
    whose successor is only half sent must be answered without waiting for the rest."""
    with DaemonProcess() as d:
        r = Raw(d.socket_path + ".arena")
        assert r.hello()[0].status == fp.OK
        r.send(b"".join(fp.frame(fp.ECHO, b"e%d" % i, 20 + i) for i in range(5)) + fp.frame(fp.COMMIT, b"\0" * 3, 25))
        replies = [r.reply() for _ in range(6)]
        assert [(h.request_id, b) for h, b, _ in replies[:5]] == [(20 + i, b"e%d" % i) for i in range(5)]
        assert replies[5][0].request_id == 25 and _error(replies[5][0], replies[5][1]) == (
            "invalid_request", "bad Commit frame: frame ends 9 bytes early", True)
        assert r.closed()
        r = Raw(d.socket_path + ".arena")
        assert r.hello()[0].status == fp.OK
        second = fp.frame(fp.ECHO, b"second", 31)
        r.send(fp.frame(fp.ECHO, b"first", 30) + second[:10])  # the next request's header and 2 bytes of it
        head, body, _ = r.reply()
        assert (head.request_id, body) == (30, b"first")
        r.send(second[10:])
        head, body, _ = r.reply()
        assert (head.request_id, body) == (31, b"second")
        r.close()


@pytest.mark.parametrize("payload, message", [
    (fp.frame(fp.LOOKUP, b"\x04\x00ab"), "bad Lookup frame: frame ends 2 bytes early"),
    (fp.frame(fp.RESERVE, fp.encode_lookup("n", [b"k"])), "bad Reserve frame: frame ends 8 bytes early"),
    (fp.frame(fp.COMMIT, b"\x00" * 11), "bad Commit frame: frame ends 1 bytes early"),
    (fp.frame(fp.EXISTS, fp.encode_exists("n", [b"k"]) + b"junk"),
     "bad Exists frame: 4 bytes left over after the body"),
    (fp.frame(fp.LOOKUP, b"\x01\x00n" + struct.pack("<IB", 1 << 30, 16)),
     "bad Lookup frame: 1073741824 keys of 16 bytes in a frame with 0 left"),
    (struct.pack("<IBBHI", 0, 77, 0, 0, 5), "bad frame: unknown op 77"),
])
def test_malformed_frames_get_invalid_request_and_a_closed_connection(daemon, payload: bytes, message: str) -> None:
    r = Raw(daemon.socket_path + ".arena")
    assert r.hello()[0].status == fp.OK
    r.send(payload)
    head, body, _ = r.reply()
    assert _error(head, body) == ("invalid_request", message, True)
    assert r.closed()
    with daemon.client() as c:                   # everyone else is served
        assert c.control_path == "fast" and c.echo(b"x") == b"x"


def test_the_engines_own_checks_and_messages_are_the_same_on_both_paths(daemon) -> None:
    with daemon.client(control="fast") as f, daemon.client(control="grpc") as g:
        f.register_namespace("m/ns")
        for c in (f, g):
            with pytest.raises(InvalidRequestError, match=r"^empty key batch: pass at least one key$"):
                c.lookup("m/ns", [])
            with pytest.raises(InvalidRequestError, match=r"^key 1 has 0 bytes: keys must be 1..64 bytes$"):
                c.exists("m/ns", [b"a", b""])
            with pytest.raises(InvalidRequestError, match=r"^key 0 has 300 bytes"):
                c.lookup("m/ns", [b"x" * 300])          # over 255: the fast client sends it over gRPC
            with pytest.raises(UnknownReservationError, match="reservation 424242 is unknown"):
                c.commit(type("R", (), {"id": 424242})())
            with pytest.raises(UnknownNamespaceError):
                c.reserve("m/other", [b"k"], [10])
        assert f.control_path == "fast" and f.echo(b"still") == b"still"   # errors keep the connection


def test_a_revoked_token_closes_its_open_connections(tmp_path: Path) -> None:
    """The reload closes bob's idle connection at once, so nothing more is answered to him: not a call, and not
    a probe his client would answer from its key index (it learns of the close when it sends the one-way HITS)."""
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    with DaemonProcess(tokens_file=tokens) as d:
        bob = Client(d.address, token_file=secret(str(tmp_path / "bob"), BOB_TOKEN))
        bob.register_namespace(B_NS)
        assert bob.put(B_NS, b"held", b"v" * 64)
        assert bob.control_path == "fast" and bob.exists(B_NS, [b"k"]) == [False]
        assert bob.probe_path == "index" and bob.probe_prefix(B_NS, [b"held"]) == (1, True)  # answered from it
        secret(tokens, f"alice {ALICE_TOKEN}\n")   # bob is removed; the daemon reloads on change
        wait_until(lambda: "closed 1 fast-path connection(s) whose token was revoked" in d.log(), timeout_s=15,
                   what="token reload")
        with pytest.raises(UnauthenticatedError, match="invalid bearer token"):
            bob.probe_prefix(B_NS, [b"held"])         # the index still says so: the closed connection refuses it
        with pytest.raises(UnauthenticatedError):       # and every new connection is refused at HELLO
            bob.exists(B_NS, [b"k"])
        with pytest.raises(UnauthenticatedError):
            request_arena(d.socket_path + ".arena", BOB_TOKEN)
        bob.close()


def test_tenants_are_checked_on_the_fast_path_exactly_as_on_grpc(tmp_path: Path) -> None:
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    with DaemonProcess(tokens_file=tokens) as d, \
            Client(d.address, token_file=secret(str(tmp_path / "a"), ALICE_TOKEN)) as alice, \
            Client(d.address, token_file=secret(str(tmp_path / "b"), BOB_TOKEN)) as bob:
        assert alice.control_path == bob.control_path == "fast"
        alice.register_namespace(A_NS)
        alice.put(A_NS, b"k", b"a" * 1000)
        res = alice.reserve(A_NS, [b"k2"], [100])
        lease = alice.lookup(A_NS, [b"k"])
        for call in (lambda: bob.lookup(A_NS, [b"k"]), lambda: bob.exists(A_NS, [b"k"]),
                     lambda: bob.reserve(A_NS, [b"z"], [10])):
            with pytest.raises(UnknownNamespaceError, match=f"unknown namespace '{A_NS}'"):
                call()
        with pytest.raises(UnknownReservationError):
            bob.commit(res)
        bob.release([lease], wait=True)                  # a foreign lease id is not released
        assert alice.stats().leases_active == 1
        alice.release([lease], wait=True)
        assert alice.stats().leases_active == 0 and alice.commit(res) == 1


def test_concurrent_clients_and_threads_get_exact_results(daemon) -> None:
    errors: list[BaseException] = []
    ns = "c/fast"
    with daemon.client() as setup:
        setup.register_namespace(ns)

    def worker(t: int) -> None:
        try:
            with daemon.client() as c:
                assert c.control_path == "fast"
                for i in range(40):
                    key, value = b"t%d-%d" % (t, i), bytes([t, i % 256]) * 3000
                    assert c.put(ns, key, value) is True
                    assert c.get(ns, key) == value
                    assert c.exists(ns, [key, b"none"]) == [True, False]
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    with daemon.client() as c:
        assert sum(n.blocks for n in c.stats().namespaces if n.name == ns) == 240


def test_a_client_dying_mid_request_and_a_daemon_restart_are_errors_then_reconnects(tmp_path: Path) -> None:
    d = DaemonProcess(workdir=str(tmp_path))
    d.start()
    try:
        r = Raw(d.socket_path + ".arena")
        assert r.hello()[0].status == fp.OK
        r.send(fp.HEADER.pack(100, fp.LOOKUP, 0, 0, 3) + b"\x01\x00")   # a header and 2 of 100 bytes, then gone
        r.close()
        c = d.client()
        c.register_namespace("r/ns")
        assert c.put("r/ns", b"k", b"v" * 100) and c.control_path == "fast"
        before = c.arena_incarnation
        d.stop(signal.SIGKILL)
        with pytest.raises(StoreUnavailableError):
            c.exists("r/ns", [b"k"])
        d.start()
        c.register_namespace("r/ns")                       # a new daemon: the old namespace is gone
        assert c.exists("r/ns", [b"k"]) == [False]          # the fast path dialled the new daemon
        assert c.put("r/ns", b"k2", b"w" * 100) is True     # its reply's incarnation remapped the arena
        assert c.arena_incarnation != before and c.get("r/ns", b"k2") == b"w" * 100
        c.close()
    finally:
        d.close()


def test_stats_health_and_metrics_say_what_went_over_the_fast_path() -> None:
    with DaemonProcess() as d, d.client() as c:
        c.register_namespace("s/ns")
        assert c.probe_path == "index"  # fetches the key index now: its one-shot connection closes below too
        # the start-up probe's connection closes in the background: wait until only ours is open
        wait_until(lambda: c.stats().control.fast_connections == 1, timeout_s=10, what="probe connection closed")
        base = c.stats().control
        assert base is not None and base.socket == d.socket_path + ".arena"
        assert c.put("s/ns", b"k", b"v" * 100) is True           # Reserve + Commit
        assert c.exists("s/ns", [b"k"]) == [True]                 # Exists
        after = c.stats().control
        assert after is not None and after.fast_requests - base.fast_requests == 3
        # one connection (this client's thread; the start-up probe's closed); one file each for it and for us
        assert after.fast_connections == base.fast_connections == 1
        assert after.arena_files_handed == base.arena_files_handed == 2
        h = c.health()
        assert (h.client_control, h.client_data, h.client_probe) == ("fast", "arena", "index")
        import urllib.request
        text = urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10).read().decode()
        assert "kvstore_fast_connections 1.0" in text and "kvstore_arena_files_handed_total 2.0" in text
        assert 'kvstore_rpc_duration_seconds_count{method="Exists"} 1.0' in text   # same histogram as gRPC


def test_a_summary_lookup_counts_without_hit_columns(daemon) -> None:
    """The scheduler's prefix probe (Client.lookup_prefix) asks for counts only: the reply carries num_prefix,
    present and tiers, and none of the four hit columns (on gRPC, the same counts)."""
    with daemon.client() as c, daemon.client(control="grpc") as g:
        c.register_namespace("sum/ns")
        keys = [b"s%02d" % i for i in range(6)]
        c.put_many("sum/ns", keys[:4], [bytes([i]) * 5000 for i in range(4)])
        assert c.lookup_prefix("sum/ns", keys) == g.lookup_prefix("sum/ns", keys) == 4
        r = Raw(daemon.socket_path + ".arena")
        assert r.hello()[0].status == fp.OK
        r.send(fp.frame(fp.LOOKUP, fp.encode_lookup("sum/ns", keys), 3, flags=fp.LOOKUP_PREFIX | fp.LOOKUP_SUMMARY))
        head, body, _ = r.reply()
        rep = fp.decode_lookup_reply(body)
        assert (rep.num_prefix, rep.present, rep.tiers, rep.lease_id) == (4, [True] * 4 + [False], [1] * 4 + [0], 0)
        assert (rep.offsets, rep.sizes, rep.generations, rep.checksums) == ([], [], [], [])
        full = c.lookup("sum/ns", keys, prefix=True, lease=False)
        assert full.num_prefix == 4 and full.sizes == [5000] * 4   # without the flag: every column
        r.close()
