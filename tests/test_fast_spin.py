"""Polling before sleeping on the same-node socket: FrameReader's spin, the daemon's Spinner, $KVSTORE_SPIN_US.

The sockets are real (socketpair, a real daemon); a socket subclass counts the polls (recv with MSG_DONTWAIT)
and the sleeping reads, so each test says exactly which way a frame was read."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvstore import Client
from kvstore.client.fast_channel import DEFAULT_SPIN_US, MAX_SPIN_US, quiet_thread, spin_us_from_env
from kvstore.errors import ConfigError
from kvstore.fastpath import protocol as fp
from kvstore.fastpath.sockets import FrameReader
from kvstore.server.config import load_config
from kvstore.server.fast_server import Spinner
from kvstore.testing import DaemonProcess


class CountingSocket(socket.socket):
    """Counts recv_into calls: polls (MSG_DONTWAIT) that found data or not, and reads that may sleep."""

    polls = polls_empty = sleeps = 0

    def recv_into(self, buffer, nbytes=0, flags=0):  # type: ignore[no-untyped-def, override]
        if flags & socket.MSG_DONTWAIT:
            self.polls += 1
            try:
                return super().recv_into(buffer, nbytes, flags)
            except BlockingIOError:
                self.polls_empty += 1
                raise
        self.sleeps += 1
        return super().recv_into(buffer, nbytes, flags)


def _pair() -> tuple[socket.socket, CountingSocket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return a, CountingSocket(fileno=b.detach())


def _frame(rid: int, body: bytes) -> bytes:
    return fp.frame(fp.ECHO, body, rid)


def _reader(sock: socket.socket, spin_s: float = 0.0) -> FrameReader:
    return FrameReader(sock, fp.HEADER.size, lambda h: fp.Header.parse(h).length, spin_s=spin_s)


def _send_later(sock: socket.socket, data: bytes, delay_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), sock.sendall(data)))
    t.start()
    return t


def test_without_spin_a_frame_is_read_by_sleeping_recv_only() -> None:
    a, b = _pair()
    with a, b:
        a.sendall(_frame(1, b"abc"))
        head, body = _reader(b).frame()
        assert (fp.Header.parse(head).request_id, body) == (1, b"abc")
        assert (b.polls, b.sleeps) == (0, 1)


def test_a_frame_arriving_while_polling_is_read_without_sleeping() -> None:
    a, b = _pair()
    with a, b:
        t = _send_later(a, _frame(7, b"x" * 5000), 0.005)
        head, body = _reader(b, spin_s=2.0).frame()
        t.join()
        assert (fp.Header.parse(head).request_id, body) == (7, b"x" * 5000)
        assert b.sleeps == 0 and b.polls >= 2 and b.polls_empty == b.polls - 1  # empty polls, then the frame


def test_a_frame_arriving_after_the_spin_is_read_by_one_sleeping_recv() -> None:
    a, b = _pair()
    with a, b:
        t = _send_later(a, _frame(9, b"late"), 0.2)
        head, body = _reader(b, spin_s=0.002).frame()
        t.join()
        assert (fp.Header.parse(head).request_id, body) == (9, b"late")
        assert b.sleeps == 1 and b.polls >= 1 and b.polls_empty == b.polls


def test_pipelined_frames_and_a_split_frame_are_read_whole_while_polling() -> None:
    a, b = _pair()
    with a, b:
        reader = _reader(b, spin_s=2.0)
        a.sendall(_frame(1, b"one") + _frame(2, b"two") + _frame(3, b"three")[:5])  # the third cut in its header
        t = _send_later(a, _frame(3, b"three")[5:], 0.005)
        got = [reader.frame() for _ in range(3)]
        t.join()
        assert [(fp.Header.parse(h).request_id, body) for h, body in got] == [(1, b"one"), (2, b"two"),
                                                                           (3, b"three")]
        assert b.sleeps == 0


def test_the_other_end_closing_while_polling_is_a_connection_error() -> None:
    a, b = _pair()
    with b:
        t = threading.Thread(target=lambda: (time.sleep(0.005), a.close()))
        t.start()
        with pytest.raises(ConnectionError, match="closed the connection"):
            _reader(b, spin_s=2.0).frame()
        t.join()
        assert b.sleeps == 0


def test_the_daemons_spinner_polls_only_after_frames_that_came_close_together() -> None:
    a, b = _pair()
    slots = threading.BoundedSemaphore(1)
    spin = Spinner(0.5, slots)
    reader = _reader(b)
    with a, b:
        a.sendall(_frame(1, b""))
        spin.frame(reader)                        # the first frame: never polled for
        assert (b.polls, b.sleeps) == (0, 1)
        t = _send_later(a, _frame(2, b""), 0.002)  # the last one came at once: poll for this one
        spin.frame(reader)
        t.join()
        assert b.sleeps == 1 and b.polls >= 1
        assert slots.acquire(blocking=False)       # the polling slot was given back
        t = _send_later(a, _frame(3, b""), 0.002)  # every slot taken by other connections: sleep instead
        polls = b.polls
        spin.frame(reader)
        t.join()
        slots.release()
        assert (b.polls, b.sleeps) == (polls, 2)
        t = _send_later(a, _frame(4, b""), 0.8)    # close again (3 came within 0.5 s), but 4 comes late
        spin.frame(reader)
        t.join()
        assert b.sleeps == 3
        polls = b.polls
        t = _send_later(a, _frame(5, b""), 0.002)  # after a late frame: no polling for the next
        spin.frame(reader)
        t.join()
        assert (b.polls, b.sleeps) == (polls, 4)


def test_spin_us_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_SPIN_US", raising=False)
    assert spin_us_from_env() == DEFAULT_SPIN_US == 300
    for raw, want in (("0", 0), (" 50 ", 50), (str(MAX_SPIN_US), MAX_SPIN_US)):
        monkeypatch.setenv("KVSTORE_SPIN_US", raw)
        assert spin_us_from_env() == want
    for bad in ("abc", "-1", "1.5", str(MAX_SPIN_US + 1)):
        monkeypatch.setenv("KVSTORE_SPIN_US", bad)
        with pytest.raises(ConfigError, match=rf"KVSTORE_SPIN_US='{bad}': use an integer number of microseconds"):
            spin_us_from_env()


def test_clients_with_and_without_polling_get_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [bytes([i]) * 16 for i in range(8)]
    values = [np.full(4096, i, dtype=np.uint8) for i in range(8)]
    with DaemonProcess(arena_bytes=64 << 20) as d:
        for spin in ("0", "300"):
            monkeypatch.setenv("KVSTORE_SPIN_US", spin)
            with Client(d.address, control="fast") as c:
                assert c.control_path == "fast"
                ns = f"spin-{spin}"
                c.register_namespace(ns)
                c.put_many(ns, keys, values)
                r = c.lookup(ns, keys, prefix=True, lease=False)
                assert r.num_prefix == 8
                out = [np.zeros(4096, dtype=np.uint8) for _ in keys]
                assert c.get_many_into(ns, keys, out) == [4096] * 8
                assert all((o == v).all() for o, v in zip(out, values))
        monkeypatch.setenv("KVSTORE_SPIN_US", "-5")
        with pytest.raises(ConfigError, match="KVSTORE_SPIN_US='-5'"):
            Client(d.address, control="fast")


CONFIG_BASE = ["--unix-socket", "/tmp/kvstore-spin-test.sock", "--disk-bytes", "0"]


def test_the_daemons_fast_spin_us_setting_is_checked() -> None:
    assert load_config(CONFIG_BASE, env={}).fast_spin_us == 200
    assert load_config([*CONFIG_BASE, "--fast-spin-us", "0"], env={}).fast_spin_us == 0
    assert load_config(CONFIG_BASE, env={"KVSTORE_FAST_SPIN_US": "10000"}).fast_spin_us == 10_000
    for bad in ("-1", "10001"):
        with pytest.raises(ConfigError, match=rf"fast_spin_us={bad}: use 0 \(never poll\) to 10000 us"):
            load_config([*CONFIG_BASE, "--fast-spin-us", bad], env={})


def test_a_daemon_that_never_polls_answers_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_SPIN_US", "0")
    keys = [bytes([i]) * 16 for i in range(4)]
    with DaemonProcess(arena_bytes=64 << 20, fast_spin_us=0) as d, Client(d.address, control="fast") as c:
        c.register_namespace("n")
        c.put_many("n", keys, [np.full(1024, i, dtype=np.uint8) for i in range(4)])
        for _ in range(20):  # close together: a polling daemon would poll here (Exists: always a round trip)
            assert c.exists("n", keys) == [True] * 4
        # the readiness probe's and this client's HELLO echoes, Reserve + Commit, 20 Exists
        assert c.stats().control.fast_requests == 2 + 2 + 20


def test_a_quiet_thread_sleeps_for_its_replies_on_any_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """quiet_thread: calls from that thread never poll, on its own connection and on one dialled elsewhere (a
    slot bank's); the same connection used again from a polling thread polls again."""
    monkeypatch.setenv("KVSTORE_SPIN_US", "300")
    with DaemonProcess(arena_bytes=64 << 20) as d, Client(d.address, control="fast") as c:
        channel = c._control.channel  # type: ignore[attr-defined]
        shared = channel.dial()
        assert channel.call(fp.ECHO, b"a") == b"a" and channel.conn().reader.spin_s == 300e-6
        seen: list[float] = []

        def quiet() -> None:
            quiet_thread()
            assert channel.call(fp.ECHO, b"b") == b"b"
            seen.append(channel.conn().reader.spin_s)
            assert channel.call_on(shared, fp.ECHO, b"c") == b"c"
            seen.append(shared.reader.spin_s)
        t = threading.Thread(target=quiet)
        t.start()
        t.join()
        assert seen == [0.0, 0.0]
        assert channel.call_on(shared, fp.ECHO, b"d") == b"d" and shared.reader.spin_s == 300e-6
