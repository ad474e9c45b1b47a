"""Both data planes reject the same bad replies with the same message (the drift protocol.py ended).

A lying peer (a raw socket for the TCP plane, a ucxx listener for the UCX plane) takes one real request off the
wire, blocks included, and answers it with a reply that breaks one rule of protocol.parse_reply. Before the
protocol was shared, the UCX plane accepted a push reply claiming more blocks stored than were pushed, and a
push reply carrying metadata (whose bytes the next call would have read as its reply).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.peer import frames as fr
from kvstore.peer.frames import Header
from kvstore.peer.membership import Member
from kvstore.peer.plane import PeerError
from tests.peer_helpers import ucx_available
from tests.peer_rig import DESC, NS, Node, make_node

Lie = Callable[[Header], bytes]
PLANES = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx not installed"))]
MAX_BLOCK = 1 << 20


def _recv_n(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "the plane closed before sending its whole request"
        out += chunk
    return out


def _block_sizes(h: Header, meta: bytes) -> list[int]:
    if h.op != fr.PUSH:
        return []
    return [int(s) for s in fr.decode_push(meta, h.count, h.payload_len, MAX_BLOCK)[2] if s]


class TcpLiar(threading.Thread):
    """Reads one request (header, metadata, blocks) off a real connection and answers `lie(header)`."""

    def __init__(self, lie: Lie) -> None:
        super().__init__(daemon=True)
        self.lie = lie
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.request: Header | None = None

    def run(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            conn.settimeout(5)
            h = fr.check_header(_recv_n(conn, fr.HEADER.size), max_keys=64, max_block_bytes=MAX_BLOCK)
            _recv_n(conn, h.meta_len + h.payload_len)
            self.request = h
            conn.sendall(self.lie(h))
            try:
                while conn.recv(65536):  # until the plane hangs up on the lie
                    pass
            except OSError:
                pass
        self.srv.close()

    def stop(self) -> None:
        self.join(5)


class UcxLiar:
    """The same over ucxx messages, on the node's own UCX loop: header, metadata, one message per block."""

    def __init__(self, node: Node, lie: Lie) -> None:
        import ucxx
        self.node, self.lie, self.request = node, lie, None

        async def answer(ep) -> None:
            raw = np.empty(fr.HEADER.size, dtype=np.uint8)
            await ep.recv(raw)
            h = fr.check_header(raw.tobytes(), max_keys=64, max_block_bytes=MAX_BLOCK)
            meta = np.empty(h.meta_len, dtype=np.uint8)
            if h.meta_len:
                await ep.recv(meta)
            for size in _block_sizes(h, meta.tobytes()):
                await ep.recv(np.empty(size, dtype=np.uint8))
            self.request = h
            out = self.lie(h)
            await ep.send(np.frombuffer(out[:fr.HEADER.size], dtype=np.uint8))
            if len(out) > fr.HEADER.size:
                await ep.send(np.frombuffer(out[fr.HEADER.size:], dtype=np.uint8))
            await self.hold.wait()  # keep the endpoint open until the plane has read (and refused) the reply

        async def listen():
            return asyncio.Event(), ucxx.create_listener(answer)

        self.hold, self.listener = self._on_loop(listen())
        self.port = self.listener.port

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.node.plane._loop).result(10)  # noqa: SLF001

    def start(self) -> None:
        pass

    def stop(self) -> None:
        async def close() -> None:
            self.hold.set()
            self.listener.close()

        self._on_loop(close())


@pytest.fixture(params=PLANES)
def node(request):
    n = make_node("a", plane=request.param, timeout_s=3.0)
    yield n
    n.close()


def _liar(node: Node, lie: Lie) -> tuple[TcpLiar | UcxLiar, Member]:
    plane = node.plane.name
    liar: TcpLiar | UcxLiar = TcpLiar(lie) if plane == "tcp" else UcxLiar(node, lie)
    liar.start()
    return liar, Member("liar", "", f"127.0.0.1:{liar.port}", plane, 0)


def _sizes(h: Header, n: int) -> bytes:
    return fr.encode_sizes(np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint64))


@pytest.mark.parametrize("op, lie, message", [
    ("push", lambda h: Header(fr.PUSH_REPLY, h.request_id, h.count + 1, 0, 0).pack(),
     "push reply says 2 blocks stored of the 1 pushed"),
    ("push", lambda h: Header(fr.PUSH_REPLY, h.request_id, 1, 4, 0).pack() + b"junk",
     "a push reply carries no metadata or payload \\(got 4 and 0 bytes\\)"),
    ("push", lambda h: Header(fr.PUSH_REPLY, h.request_id + 1, 1, 0, 0).pack(),
     "push reply for request \\d+; expected request \\d+"),
    ("probe", lambda h: Header(fr.PROBE_REPLY, h.request_id, 1, 1, 0).pack() + b"\x01",
     "probe reply with 1 keys for a request of 2"),
    ("probe", lambda h: Header(fr.FETCH_REPLY, h.request_id, 2, 32, 0).pack() + _sizes(h, 2),
     "unexpected op 2"),
    ("fetch", lambda h: Header(fr.FETCH_REPLY, h.request_id + 1, 2, 32, 0).pack() + _sizes(h, 2),
     "fetch reply for request \\d+; expected request \\d+"),
    ("fetch", lambda h: Header(fr.FETCH_REPLY, h.request_id, 2, 16, 0).pack() + bytes(16),
     "fetch reply with 16 bytes of metadata for 2 keys \\(expected 32\\)"),
])
def test_both_planes_refuse_the_same_bad_reply(node: Node, op: str, lie: Lie, message: str) -> None:
    node.put(b"mine", b"\x5a" * 4096)
    liar, member = _liar(node, lie)
    try:
        with pytest.raises(PeerError, match=message):
            if op == "push":
                node.plane.push(member, DESC, [b"mine", b"absent"])   # one block held here: one pushed
            elif op == "probe":
                node.plane.probe(member, NS, [b"x", b"y"])
            else:
                node.plane.fetch(member, NS, [b"x", b"y"])
    finally:
        liar.stop()
    assert liar.request is not None and liar.request.count == (1 if op == "push" else 2)
    pc = node.counters.snapshot()
    assert (pc["frame_deadline_exceeded"], pc["slot_deadline_exceeded"]) == (0, 0)
    active, reserved_bytes, _ = node.stats()
    assert (active, reserved_bytes) == (0, 0)  # nothing reserved is left behind by a refused reply
    assert node.read(b"mine") == b"\x5a" * 4096
