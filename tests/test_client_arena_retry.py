"""An auto-mode client whose arena handoff fails for a reason that can pass does not stream for good.

The daemon's same-node socket is hidden (renamed) to make the handoff fail the way a restarting or saturated
daemon makes it fail, while its gRPC socket keeps answering. Before, such a client fell back to streaming
until its next reconnect, and the vLLM connector, which offers no hits without the arena, offered none.
"""

from __future__ import annotations

import logging
import os
import threading

import pytest

from kvstore import Client
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client import connect
from kvstore.testing import DaemonProcess, wait_until

BLOCK = bytes(range(256)) * 64  # 16 KiB


def _fast_socket(daemon: DaemonProcess) -> str:
    with daemon.client(mode="stream") as c:
        path = c.stats().control.socket
    assert path and os.path.exists(path)
    return path


def _handed(daemon: DaemonProcess) -> int:
    with daemon.client(mode="stream") as c:
        return c.stats().control.arena_files_handed


def test_streaming_client_maps_the_arena_once_the_socket_answers_again(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(connect, "ARENA_PATIENCE_S", 0.0)  # no patience: the connect itself falls back
    monkeypatch.setattr(connect, "ARENA_RETRY_S", 0.2)
    sock = _fast_socket(daemon)
    handed = _handed(daemon)
    os.rename(sock, sock + ".hidden")
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.client.connect"):
            c = Client(daemon.address)
        assert [r.getMessage() for r in caplog.records if "retrying the arena" in r.getMessage()] != []
        assert c.mode == "stream"
        c.register_namespace("retry-ns")
        assert c.put("retry-ns", b"streamed", BLOCK) is True
    finally:
        os.rename(sock + ".hidden", sock)
    try:
        wait_until(lambda: c.mode == "arena", timeout_s=10, what="the client to map the arena again")
        assert _handed(daemon) == handed + 1
        assert c.put("retry-ns", b"through-arena", BLOCK[::-1]) is True
        assert c.get_many("retry-ns", [b"streamed", b"through-arena", b"absent"]) == [BLOCK, BLOCK[::-1], None]
        assert c.health().client_data == "arena"
    finally:
        c.close()


def test_connect_waits_out_a_short_handoff_failure(daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    sock = _fast_socket(daemon)
    os.rename(sock, sock + ".hidden")
    back = threading.Timer(0.3, os.rename, (sock + ".hidden", sock))
    back.start()
    try:
        with caplog.at_level(logging.INFO, logger="kvstore.client.connect"):
            with Client(daemon.address) as c:
                assert c.mode == "arena"
        assert [r for r in caplog.records if "streaming" in r.getMessage()] == []
    finally:
        back.join()
        if not os.path.exists(sock):
            os.rename(sock + ".hidden", sock)


def test_which_handoff_failures_are_retried(daemon: DaemonProcess) -> None:
    """Only a socket on this host that did not answer is worth retrying: another host, or no socket, never is."""
    with daemon.client() as c:
        h, rpc = c._health, c._rpc
    here = pb.HealthResponse()
    here.CopyFrom(h)
    here.arena.socket = os.path.join(os.path.dirname(daemon.socket_path), "nobody-listens.sock")
    m, why, transient = connect.map_arena(here, rpc)
    assert (m, transient) == (None, True) and "nobody-listens.sock" in why
    no_socket = pb.HealthResponse()
    no_socket.CopyFrom(h)
    no_socket.arena.socket = ""
    assert connect.map_arena(no_socket, rpc) == (None, "the daemon has no unix socket to hand out its arena "
                                                       "(unix_socket is off)", False)
    elsewhere = pb.HealthResponse()
    elsewhere.CopyFrom(h)
    elsewhere.hostname = "another-host.invalid"
    assert connect.map_arena(elsewhere, rpc) == (None, "daemon runs on another-host.invalid, not on this host",
                                                 False)
    assert connect.streaming_because("no socket", False) is None
