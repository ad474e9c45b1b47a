"""The arena socket (kvstore/arena/handoff.py) against a real daemon: who gets which file, and bad input.

Exact replies are read with a raw socket: header (magic, status, incarnation, message length), message, and
the descriptors that came with it (none unless the status is OK).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from kvstore import Client
from kvstore.arena.handoff import request_arena
from kvstore.errors import InvalidRequestError, UnauthenticatedError
from kvstore.testing import DaemonProcess, wait_until
from tests.tenant_helpers import ALICE_TOKEN, BOB_TOKEN, secret

REP = struct.Struct("<8sIQI")


def _raw(path: str, payload: bytes, *, read: bool = True) -> tuple[int, str, int]:
    """(status, message, descriptors received) for one raw request."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(payload)
        data, fds, _, _ = socket.recv_fds(s, 4096, 4)
        for fd in fds:
            os.close(fd)
        magic, status, _, n = REP.unpack(data[:REP.size])
        assert magic == b"KVARENA1"
        return status, data[REP.size: REP.size + n].decode(), len(fds)


def _req(token: bytes, magic: bytes = b"KVARENA1", length: int | None = None) -> bytes:
    return struct.pack("<8sI", magic, len(token) if length is None else length) + token


def test_without_tokens_every_local_process_gets_the_one_shared_file() -> None:
    with DaemonProcess() as d:
        path = d.socket_path + ".arena"
        assert _raw(path, _req(b"")) == (0, "", 1)
        assert _raw(path, _req(b"anything-at-all-here")) == (0, "", 1)
        with Client(d.tcp_address) as c:     # a TCP client on the same host is told where the socket is
            assert c.mode == "arena"
            c.register_namespace("h/ns")
            assert c.put("h/ns", b"k", b"z" * 5000) and c.get("h/ns", b"k") == b"z" * 5000


def test_bad_requests_get_a_clear_refusal_and_no_descriptor(tmp_path: Path) -> None:
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\n")
    with DaemonProcess(tokens_file=tokens) as d:
        path = d.socket_path + ".arena"
        assert _raw(path, _req(b"", magic=b"GET / HT")) == (2, "not an arena request (bad magic)", 0)
        assert _raw(path, _req(b"", length=1 << 30)) == (2, "token of 1073741824 bytes is longer than 4096", 0)
        assert _raw(path, _req(b"")) == (1, "missing bearer token", 0)
        assert _raw(path, _req(b"x" * 20)) == (1, "invalid bearer token (not in the daemon's tokens_file)", 0)
        assert _raw(path, _req(ALICE_TOKEN.encode())) == (0, "", 1)
        with pytest.raises(UnauthenticatedError, match="arena refused: invalid bearer token"):
            request_arena(path, "y" * 20)
        with pytest.raises(InvalidRequestError, match="longer than 4096"):
            request_arena(path, "y" * 5000)
        # a client that connects and stalls is cut at the deadline and blocks nobody meanwhile
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stalled.connect(path)
        stalled.sendall(b"KVAR")                 # half a header, then nothing
        t0 = time.monotonic()
        fd, _ = request_arena(path, ALICE_TOKEN)
        os.close(fd)
        assert time.monotonic() - t0 < 1.0
        stalled.settimeout(10)
        assert stalled.recv(100) == b""          # closed by the daemon, without a reply or a descriptor
        assert time.monotonic() - t0 < 5.0
        stalled.close()
        assert d.proc.poll() is None and "refused an arena request: missing bearer token" in d.log()


def test_a_revoked_token_gets_no_arena(tmp_path: Path) -> None:
    tokens = secret(str(tmp_path / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n")
    with DaemonProcess(tokens_file=tokens) as d:
        path = d.socket_path + ".arena"
        fd, _ = request_arena(path, BOB_TOKEN)
        os.close(fd)
        secret(tokens, f"alice {ALICE_TOKEN}\n")   # bob is removed; the daemon reloads on change
        wait_until(lambda: "tokens_file reloaded" in d.log(), timeout_s=15, what="token reload")
        with pytest.raises(UnauthenticatedError):
            request_arena(path, BOB_TOKEN)
        fd, _ = request_arena(path, ALICE_TOKEN)
        os.close(fd)


def test_many_clients_at_once_all_get_their_file() -> None:
    with DaemonProcess() as d:
        path = d.socket_path + ".arena"
        got: list[int] = []
        lock = threading.Lock()

        def one() -> None:
            fd, inc = request_arena(path, "")
            with lock:
                got.append(inc)
            os.close(fd)

        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with d.client() as c:
            assert got == [c.arena_incarnation] * 12
