"""xxh3 on the peer data plane: every block is verified before it is committed, hashed once as it lands, and
a sender hashes a block committed without a checksum once in its life, not at every fetch.

In-process nodes (tests/peer_rig.py: a real engine, LocalStore and TcpPlane on loopback); the damaged sender
is a raw socket speaking the real frames.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import xxhash

from kvstore.peer import frames as fr
from kvstore.peer import local as local_mod
from kvstore.peer.membership import Member
from tests.peer_deadline_helpers import nodes_fixture, push_frame, recv_n
from tests.peer_rig import BLOCK, NS, addr

pytestmark = pytest.mark.timeout(60)
nodes = nodes_fixture()


def _value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


class DamagingPeer(threading.Thread):
    """Answers one FETCH with every key's true size and xxh3, then the blocks with one byte of block
    `damaged` flipped (a bit error on the way)."""

    def __init__(self, values: list[bytes], damaged: int) -> None:
        super().__init__(daemon=True)
        self.values, self.damaged = values, damaged
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.member = Member("f", "", f"127.0.0.1:{self.srv.getsockname()[1]}", "tcp", 0)

    def run(self) -> None:
        conn, _ = self.srv.accept()
        with conn:
            h = fr.check_header(recv_n(conn, fr.HEADER.size), max_keys=64, max_block_bytes=1 << 20)
            recv_n(conn, h.meta_len)
            sizes = np.array([len(v) for v in self.values])
            sums = np.array([xxhash.xxh3_64_intdigest(v) for v in self.values], dtype=np.uint64)
            table = fr.encode_sizes(sizes, sums)
            body = bytearray(b"".join(self.values))
            body[self.damaged * BLOCK + 1234] ^= 0x01
            conn.sendall(fr.Header(fr.FETCH_REPLY, h.request_id, h.count, len(table), len(body)).pack() + table
                         + bytes(body))
            conn.settimeout(5)
            try:
                conn.recv(1)  # until the fetching node is done with the connection (it pools it, then closes)
            except OSError:
                pass
        self.srv.close()


def test_a_fetched_block_that_fails_its_checksum_stores_none_of_the_batch(nodes) -> None:
    b = nodes("b", timeout_s=5.0)
    keys = [b"k0", b"k1", b"k2"]
    peer = DamagingPeer([_value(i) for i in range(3)], damaged=1)
    peer.start()
    assert b.plane.fetch(peer.member, NS, keys) == 0
    assert b.counters.get("checksum_failures") == 1
    active, reserved_bytes, c = b.stats()
    assert (active, reserved_bytes) == (0, 0)
    assert (c["reserved_blocks"], c["aborted_blocks"], c["committed_blocks"], c["checksum_failures"]) == (3, 3, 0, 1)
    assert b.engine.exists(NS, keys) == [False] * 3


def test_a_pushed_block_that_fails_its_checksum_is_not_stored(nodes) -> None:
    b = nodes("b", timeout_s=5.0)
    value = _value(7)
    frame = bytearray(push_frame(b"pushed"))
    # push_frame carries checksum 0 ("none"): put the true one in its size table, then damage one byte
    frame[-8:] = np.array([xxhash.xxh3_64_intdigest(value)], dtype="<u8").tobytes()
    body = bytearray(value)
    body[99] ^= 0x80
    with socket.create_connection(addr(b)) as s:
        s.sendall(bytes(frame) + bytes(body))
        h = fr.check_header(recv_n(s, fr.HEADER.size), max_keys=64, max_block_bytes=1 << 20)
    assert (h.op, h.request_id, h.count) == (fr.PUSH_REPLY, 7, 0)
    assert b.counters.get("checksum_failures") == 1
    _, _, c = b.stats()
    assert (c["reserved_blocks"], c["aborted_blocks"], c["committed_blocks"]) == (1, 1, 0)
    assert b.read(b"pushed") is None


def test_a_sender_hashes_a_block_committed_without_a_checksum_once(nodes, monkeypatch) -> None:
    a, b = nodes("a", timeout_s=5.0), nodes("b", timeout_s=5.0)
    keys = [b"x0", b"x1"]
    values = [_value(10), _value(11)]
    for k, v in zip(keys, values):
        a.put(k, v)  # a local client's commit: no checksum
    digests = [xxhash.xxh3_64_intdigest(v) for v in values]
    assert a.engine.lookup(NS, keys, lease=False).checksums == [0, 0]

    calls: list[int] = []
    real = xxhash.xxh3_64_intdigest

    def counting(data: object) -> int:
        calls.append(len(memoryview(data)))  # type: ignore[arg-type]  # memoryviews of arena slots
        return real(data)  # type: ignore[arg-type]
    monkeypatch.setattr(local_mod.xxhash, "xxh3_64_intdigest", counting)

    # first fetch: the sender hashes both blocks (and remembers), the receiver hashes both as they land
    assert b.plane.fetch(a.member, NS, keys) == 2
    assert len(calls) == 4
    assert a.engine.lookup(NS, keys, lease=False).checksums == digests
    assert b.engine.lookup(NS, keys, lease=False).checksums == digests
    assert [b.read(k) for k in keys] == values
    # second fetch of the same blocks: only the receiver hashes
    b.engine.delete(NS, keys)
    calls.clear()
    assert b.plane.fetch(a.member, NS, keys) == 2
    assert len(calls) == 2
    assert [b.read(k) for k in keys] == values


def test_note_checksums_sets_only_missing_checksums_of_the_leases_own_blocks(nodes) -> None:
    a = nodes("a")
    off0 = a.put(b"n0", _value(20))
    r = a.engine.reserve(NS, [b"n1"], [BLOCK])
    a.view[r.offsets[0]: r.offsets[0] + BLOCK] = np.frombuffer(_value(21), dtype=np.uint8)
    assert a.engine.commit(r.reservation_id, [777]) == 1     # committed with a checksum of its own
    off1 = r.offsets[0]
    other = a.put(b"n2", _value(22))                          # not in the lease below
    lease = a.engine.lookup(NS, [b"n0", b"n1"], lease=True)
    assert sorted(lease.offsets) == sorted([off0, off1])
    # n0 is set, n1 keeps its own, n2 is not this lease's, an offset nobody holds is ignored
    assert a.engine.note_checksums(lease.lease_id, [off0, off1, other, 12345], [101, 202, 303, 404]) == 1
    assert a.engine.lookup(NS, [b"n0", b"n1", b"n2"], lease=False).checksums == [101, 777, 0]
    assert a.engine.note_checksums(lease.lease_id, [off0], [0]) == 0  # 0 is "none": never stored
    assert a.engine.release([lease.lease_id]) == 1
    assert a.engine.note_checksums(lease.lease_id, [other], [505]) == 0   # a released lease sets nothing
    assert a.engine.lookup(NS, [b"n2"], lease=False).checksums == [0]


def test_landed_blocks_are_checked_with_the_digest_taken_as_they_landed(nodes) -> None:
    b = nodes("b")
    values = [_value(30), _value(31), _value(32)]
    sums = np.array([xxhash.xxh3_64_intdigest(v) for v in values], dtype=np.uint64)
    inc = b.local.receive(NS, [b"l0", b"l1", b"l2"], [BLOCK] * 3)
    assert inc is not None
    for view, v in zip(inc.views, values):
        assert view is not None
        view[:] = v
    inc.landed(0)
    inc.landed(2)            # block 1 is hashed at finish (a plane that does not report landings: ucx)
    assert inc.digests == {0: int(sums[0]), 2: int(sums[2])}
    assert inc.finish(sums) == 3
    assert [b.read(k) for k in (b"l0", b"l1", b"l2")] == values
    # a landed block whose digest is not the sender's: the whole reservation is aborted, counted
    inc = b.local.receive(NS, [b"m0", b"m1"], [BLOCK] * 2)
    assert inc is not None
    for view, v in zip(inc.views, values[:2]):
        assert view is not None
        view[:] = v
    inc.landed(0)
    inc.landed(1)
    assert inc.finish(np.array([sums[0], sums[2]], dtype=np.uint64)) == 0
    assert b.counters.get("checksum_failures") == 1
    assert b.engine.exists(NS, [b"m0", b"m1"]) == [False, False]
    active, reserved_bytes, _ = b.stats()
    assert (active, reserved_bytes) == (0, 0)
