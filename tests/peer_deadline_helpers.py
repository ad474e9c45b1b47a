"""Shared parts of the peer deadline tests (tests/test_peer_deadlines*.py): the byte patterns an arena scan tells
apart, raw frames and reads for an attacker speaking the real protocol, a byte trickler, a peer that answers a
FETCH and stalls, and the in-process node factory fixture (tests/peer_rig.py nodes, closed after the test).

Patterns, so that the arena scan can tell who wrote what:
    0xA1  the honest first half of a block          0xB2  bytes trickled while the reservation is live
    0xC3  bytes sent after the cutoff (must never land anywhere)
    0xD4  the block of the slot's next owner (must read back exactly)
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvstore.peer import frames as fr
from kvstore.peer.membership import Member
from tests.peer_rig import BLOCK, DESC, Node, make_node

__all__ = ["SLACK", "HALF", "A1", "B2", "C3", "D4", "push_frame", "recv_n", "Trickler", "slot_of", "StallingPeer",
           "nodes_fixture"]

SLACK = 0.6  # scheduling on a loaded 2-core box; every bound below is deadline + SLACK
HALF = BLOCK // 2
A1, B2, C3, D4 = 0xA1, 0xB2, 0xC3, 0xD4


def push_frame(key: bytes, size: int = BLOCK, rid: int = 7) -> bytes:
    meta = fr.encode_push(DESC, [key], np.array([size]), np.array([0], dtype=np.uint64))
    return fr.Header(fr.PUSH, rid, 1, len(meta), size).pack() + meta


def recv_n(s: socket.socket, n: int) -> bytes:
    out = b""
    s.settimeout(5)
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "closed"
        out += chunk
    return out


class Trickler(threading.Thread):
    """Sends one byte of `pattern` every `interval_s` until stopped; counts what the kernel accepted."""

    def __init__(self, sock: socket.socket, pattern: int, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.sock, self.pattern, self.interval_s = sock, pattern, interval_s
        self.sent: dict[int, int] = {B2: 0, C3: 0}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            b = self.pattern
            try:
                self.sock.send(bytes([b]))
                self.sent[b] += 1
            except OSError:
                pass  # closed by the node: the attacker keeps trying anyway
            self.halt.wait(self.interval_s)

    def stop(self) -> None:
        self.halt.set()
        self.join(5)


def slot_of(node: Node) -> int:
    """Where the honest half landed: the slot's offset (exactly HALF bytes of 0xA1, contiguous)."""
    where = np.flatnonzero(node.view == A1)
    assert len(where) == HALF and where[-1] - where[0] == HALF - 1
    return int(where[0])



def nodes_fixture() -> Callable[..., Any]:
    """`nodes = nodes_fixture()` in a test module: `nodes(name, **opts)` makes an in-process node (make_node),
    every one closed at the end of the test."""

    @pytest.fixture
    def nodes():
        made: list[Node] = []

        def make(name: str, **opts: object) -> Node:
            made.append(make_node(name, **opts))
            return made[-1]

        yield make
        for n in made:
            n.close()
    return nodes


class StallingPeer(threading.Thread):
    """Answers one FETCH with a valid header and size table claiming every key, sends 1000 bytes of the
    payload, then trickles; records when the fetching node hung up."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.member = Member("f", "", f"127.0.0.1:{self.srv.getsockname()[1]}", "tcp", 0)
        self.hung_up = threading.Event()

    def run(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            h = fr.check_header(recv_n(conn, fr.HEADER.size), max_keys=64, max_block_bytes=1 << 20)
            recv_n(conn, h.meta_len)
            sizes = np.full(h.count, BLOCK)
            table = fr.encode_sizes(sizes, np.zeros(h.count, dtype=np.uint64))
            conn.sendall(fr.Header(fr.FETCH_REPLY, h.request_id, h.count, len(table), h.count * BLOCK).pack()
                         + table + bytes([A1]) * 1000)
            conn.settimeout(0.05)
            while True:
                try:
                    conn.send(bytes([B2]))
                    if conn.recv(1) == b"":
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
        self.hung_up.set()
        self.srv.close()

