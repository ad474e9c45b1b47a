"""Hand-off frames that try to break a real daemon: blocks it does not own, a flood past its intake budget,
malformed and oversized frames. Each is refused and counted; the node keeps serving (the next honest frame on
the same connection, or a new one, is answered, and its own clients never notice).

Three real daemons on a real etcd; b's hand-off intake is 1 MiB/s, the smallest budget it takes.
"""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack

import numpy as np
import pytest
import xxhash

from kvstore.peer import frames as fr
from kvstore.peer import protocol as proto
from kvstore.peer.frames import NamespaceDesc
from kvstore.peer.placement import owners
from kvstore.testing import wait_until
from tests.peer_helpers import Cluster, needs_etcd, register

pytestmark = [needs_etcd]

NS = "hand@d/t"
DESC = NamespaceDesc(NS, "m", "d", "t", 0)
LIMITS = proto.Limits(max_keys=256, max_block_bytes=4 << 20)


@pytest.fixture(scope="module")
def cluster():
    with ExitStack() as stack:
        cl = Cluster(stack, timeout_s=5.0, peer_handoff_intake_bytes_per_s=1 << 20)
        register(cl.clients, NS)
        yield cl


def _port(cl: Cluster, name: str) -> tuple[str, int]:
    host, _, port = cl.clients[name].health().peers.data_address.rpartition(":")
    return host, int(port)


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    s.settimeout(10)
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return out


def _closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def _handoff(s: socket.socket, rid: int, keys: list[bytes], values: list[bytes]) -> int:
    """One HANDOFF push over `s`; the blocks the receiver says it stored."""
    sizes = np.array([len(v) for v in values], dtype=np.int64)
    sums = np.array([xxhash.xxh3_64_intdigest(v) for v in values], dtype=np.uint64)
    req = proto.push_request(rid, DESC, keys, sizes, sums, handoff=True)
    assert req is not None
    s.sendall(req.pack() + b"".join(values))
    return proto.push_result(proto.parse_reply(_recv(s, fr.HEADER.size), req.header, LIMITS))


def _keys(cl: Cluster, name: str, owned: bool, n: int, tag: bytes) -> list[bytes]:
    """n keys that `name` owns (owned) or ranks last for, under the three-node member set."""
    ids = list(cl.ids)
    me = cl.nodes[name].node_id
    out = []
    for i in range(10000):
        k = tag + b"-%05d" % i
        ranking = owners(NS, k, ids, 3)
        if (ranking[0] == me) if owned else (ranking[-1] == me):
            out.append(k)
            if len(out) == n:
                return out
    raise AssertionError("not enough keys")


def test_blocks_the_receiver_does_not_own_are_refused_and_counted(cluster: Cluster) -> None:
    b = cluster.clients["b"]
    before = cluster.counters("b")
    foreign = _keys(cluster, "b", owned=False, n=4, tag=b"foreign")
    mine = _keys(cluster, "b", owned=True, n=2, tag=b"mine")
    values = [bytes([i]) * 1000 for i in range(6)]
    time.sleep(1.1)  # a full intake bucket
    with socket.create_connection(_port(cluster, "b")) as s:
        assert _handoff(s, 1, foreign + mine, values) == 2
        assert _handoff(s, 2, mine, values[4:]) == 0      # the same connection still answers (already there)
    after = cluster.counters("b")
    assert after["handoff_refused"] - before["handoff_refused"] == 4
    assert after["handoff_received"] - before["handoff_received"] == 2
    assert after["frame_errors"] == before["frame_errors"]
    assert b.exists(NS, foreign + mine) == [False] * 4 + [True] * 2
    assert b.get_many(NS, mine) == values[4:]


def test_a_flood_of_handoffs_is_refused_whole_and_counted(cluster: Cluster) -> None:
    b = cluster.clients["b"]
    before = cluster.counters("b")
    keys = _keys(cluster, "b", owned=True, n=8, tag=b"flood")
    values = [bytes([40 + i]) * (512 << 10) for i in range(8)]   # 4 MiB: four seconds of b's budget
    time.sleep(1.1)
    stored = []
    with socket.create_connection(_port(cluster, "b")) as s:
        for i in range(4):
            stored.append(_handoff(s, 10 + i, keys[2 * i: 2 * i + 2], values[2 * i: 2 * i + 2]))
    assert stored[0] == 2 and 0 in stored[1:]      # the first fills the bucket; one right after it is refused
    after = cluster.counters("b")
    refused_frames = after["handoff_flood_refused"] - before["handoff_flood_refused"]
    assert refused_frames == stored.count(0)
    assert b.exists(NS, keys) == [n == 2 for n in stored for _ in range(2)]
    assert b.health().status == "SERVING"
    b.put_many(NS, [b"own-put"], [b"p" * 100])          # its own clients were never refused room
    assert b.get_many(NS, [b"own-put"]) == [b"p" * 100]


@pytest.mark.parametrize("header, why", [
    (fr.Header(fr.PROBE, 1, 1, 9, 0, fr.HANDOFF).pack(), "the hand-off flag on a probe"),
    (fr.Header(fr.PUSH, 1, 1, 9, 100, 4).pack(), "an unknown flag"),
    (fr.Header(fr.PUSH, 1, 100000, 9, 100, fr.HANDOFF).pack(), "more keys than a frame may carry"),
    (fr.Header(fr.PUSH, 1, 1, 9, 1 << 40, fr.HANDOFF).pack(), "a payload over the block limit"),
], ids=["flag-on-probe", "unknown-flag", "too-many-keys", "oversized"])
def test_malformed_handoff_frames_close_that_connection_only(cluster: Cluster, header: bytes, why: str) -> None:
    before = cluster.counters("b")
    with socket.create_connection(_port(cluster, "b")) as s:
        s.sendall(header + b"\x00" * 9)
        assert _closed_by_peer(s), why
    c = cluster.clients["b"]
    wait_until(lambda: cluster.counters("b")["frame_errors"] == before["frame_errors"] + 1, 5, 0.02, "frame_errors")
    # still serving: a new peer connection is answered, and local clients never noticed
    keys = _keys(cluster, "b", owned=True, n=1, tag=why.encode())
    time.sleep(1.1)
    with socket.create_connection(_port(cluster, "b")) as s:
        assert _handoff(s, 5, keys, [b"z" * 100]) == 1
    assert c.get_many(NS, keys) == [b"z" * 100]
