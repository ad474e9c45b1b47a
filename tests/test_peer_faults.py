"""Faults in a real three-daemon cluster: garbage on the data port, etcd going away and back, kill -9."""

from __future__ import annotations

import signal
import socket
import threading
import time
from contextlib import ExitStack

import numpy as np
import pytest

from kvstore.peer import frames as fr
from kvstore.testing import wait_until
from tests.peer_helpers import Cluster, blocks, needs_etcd, register

pytestmark = [needs_etcd]


@pytest.fixture(scope="module")
def cluster():
    with ExitStack() as stack:
        yield Cluster(stack, plane="tcp", ttl_s=2.0, timeout_s=1.0)


def _data_port(cluster: Cluster, name: str) -> tuple[str, int]:
    addr = cluster.clients[name].health().peers.data_address
    host, _, port = addr.rpartition(":")
    return host, int(port)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_raw_probe_gets_exactly_the_presence_of_each_key(cluster: Cluster) -> None:
    ns = f"probe-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    owner = cluster.owner(ns, b"here")  # the writer keeps no copy of a block it does not own (guests.py)
    cluster.clients[owner].put_many(ns, [b"here"], [b"x" * 5000])
    meta = fr.encode_fetch(ns, [b"absent", b"here", b"here"])
    with socket.create_connection(_data_port(cluster, owner)) as s:
        s.sendall(fr.Header(fr.PROBE, 42, 3, len(meta), 0).pack() + meta)
        h = fr.check_header(_recv(s, fr.HEADER.size), max_keys=16, max_block_bytes=1 << 20)
        assert (h.op, h.request_id, h.count, h.meta_len, h.payload_len) == (fr.PROBE_REPLY, 42, 3, 3, 0)
        assert fr.decode_presence(_recv(s, 3), 3) == [False, True, True]
        unknown = fr.encode_fetch("never-registered", [b"k"])   # an unknown namespace: not here, no error
        s.sendall(fr.Header(fr.PROBE, 43, 1, len(unknown), 0).pack() + unknown)
        assert _recv(s, fr.HEADER.size + 1)[-1:] == b"\x00"


def _recv(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "connection closed"
        out += chunk
    return out


def test_malformed_and_truncated_frames_close_the_connection_only(cluster: Cluster) -> None:
    addr = _data_port(cluster, "b")
    before = cluster.counters("b")["frame_errors"]
    bad_magic = b"JUNK" + bytes(28)
    too_many = fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.FETCH, 0, 1, 10**6, 10, 0)
    oversized_meta = fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.FETCH, 0, 1, 1, fr.MAX_META_BYTES + 1, 0)
    reply_op = fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.FETCH_REPLY, 0, 1, 1, 0, 0)
    bad_version = fr.HEADER.pack(fr.MAGIC, 99, fr.FETCH, 0, 1, 1, 0, 0)
    probe_reply_op = fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.PROBE_REPLY, 0, 1, 1, 1, 0) + b"\x01"
    probe_meta = fr.encode_fetch("ns", [b"k"])
    probe_with_payload = fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.PROBE, 0, 1, 1, len(probe_meta), 5) + probe_meta
    for garbage in (bad_magic, too_many, oversized_meta, reply_op, bad_version, probe_reply_op, probe_with_payload):
        with socket.create_connection(addr) as s:
            s.sendall(garbage)
            assert _closed_by_peer(s)
    # truncated: half a header, then half a frame's metadata, then a push whose payload stops short
    meta = fr.encode_fetch("ns", [b"k"])
    push_meta = fr.encode_push(fr.NamespaceDesc("trunc-ns"), [b"k"], np.array([4096]),
                               np.array([0], dtype="uint64"))
    truncated = [
        fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.FETCH, 0, 1, 1, len(meta), 0)[:10],
        fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.FETCH, 0, 1, 1, len(meta), 0) + meta[:3],
        fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.PROBE, 0, 1, 1, len(meta), 0) + meta[:2],
        fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.PUSH, 0, 1, 1, len(push_meta), 4096) + push_meta + b"x" * 100,
    ]
    for frame in truncated:
        with socket.create_connection(addr) as s:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)  # the sender gives up mid-frame
            assert _closed_by_peer(s)
    # inconsistent metadata: sizes that do not add up to the payload, and a key table longer than the frame
    lying = fr.encode_push(fr.NamespaceDesc("x"), [b"k"], np.array([10]),
                           np.array([0], dtype="uint64"))
    with socket.create_connection(addr) as s:
        s.sendall(fr.HEADER.pack(fr.MAGIC, fr.VERSION, fr.PUSH, 0, 1, 1, len(lying), 11) + lying)
        assert _closed_by_peer(s)
    wait_until(lambda: cluster.counters("b")["frame_errors"] - before == 12, 5, what="12 frame errors on b")
    # b is alive and still serves peers: a block put on b reads on a
    ns = f"after-garbage-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    key = next(k for k in (b"g%d" % i for i in range(100)) if cluster.owner(ns, k) == "b")
    value = blocks(1, 50_000, seed=4)[0]
    cluster.clients["b"].put_many(ns, [key], [value])
    assert cluster.clients["a"].get_many(ns, [key]) == [value]
    assert cluster.nodes["b"].proc.poll() is None


def test_etcd_down_nodes_keep_serving_and_rejoin(cluster: Cluster) -> None:
    ns = f"etcd-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    cluster.etcd.stop()
    try:
        for name in "abc":
            c = cluster.clients[name]
            wait_until(lambda: not c.health().peers.etcd_connected, 10, 0.05, f"{name} to notice etcd is down")
        # own tiers and peers keep working with the last member set
        keys = [b"e%d" % i for i in range(6)]
        values = blocks(6, 32_000, seed=5)
        cluster.clients["a"].put_many(ns, keys, values)
        cluster.wait_pushes("a")  # c asks each key's owner: the owner must have it before c reads
        assert cluster.clients["c"].get_many(ns, keys) == values
        assert len(cluster.clients["b"].health().peers.members) == 3
    finally:
        cluster.etcd.start()
    for name in "abc":
        c = cluster.clients[name]
        wait_until(lambda: c.health().peers.etcd_connected, 15, 0.05, f"{name} to reconnect to etcd")
    cluster.wait_members(3)
    assert all(cluster.counters(n)["etcd_errors"] > 0 for n in "abc")


WRITES = 400  # the kill test's background puts of 64 KiB: 25 MiB at most, over at least 1.6 s


def test_kill_9_mid_transfer(cluster: Cluster) -> None:
    """Runs last in this module: b dies with -9 while a keeps putting (pushing) and c keeps reading."""
    ns = f"kill-{time.monotonic_ns()}"
    register(cluster.clients, ns)
    a, c = cluster.clients["a"], cluster.clients["c"]
    keys = [b"k%03d" % i for i in range(48)]
    values = blocks(48, 128 << 10, seed=6)
    a.put_many(ns, keys, values)
    cluster.wait_pushes("a")
    on_b = [k for k in keys if cluster.owner(ns, k) == "b"]
    assert on_b and cluster.clients["b"].exists(ns, on_b) == [True] * len(on_b)
    # traffic in flight: a puts new blocks (pushes to b and c), c reads a's blocks, while b is killed
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        # paced and bounded: WRITES x 64 KiB stay well inside a's 64 MiB arena, so the blocks read back below
        # are never evicted by this traffic (unpaced, a fast CPU put the whole arena through in under a second
        # and a's own blocks were gone before c asked for them)
        i = 0
        try:
            while not stop.is_set() and i < WRITES:
                a.put_many(ns, [b"w%05d" % i], [bytes([i % 256]) * 65536])
                i += 1
                time.sleep(0.004)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    dropped_before = cluster.counters("a")["pushes_dropped"]
    misses_before = cluster.counters("c")["fetch_misses"]
    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.3)
    cluster.nodes["b"].stop(signal.SIGKILL)
    # c never held b's blocks (not their owner): reading them is a miss, within the timeout
    start = time.monotonic()
    assert c.get_many(ns, on_b) == [None] * len(on_b)
    assert time.monotonic() - start < 1.0 + 1.5
    assert cluster.counters("c")["fetch_misses"] - misses_before == len(on_b)
    # a's other blocks still read on c (from their owners a and c)
    rest = [k for k in keys if k not in on_b]
    assert c.get_many(ns, rest) == [values[keys.index(k)] for k in rest]
    # b leaves the member set when its lease expires (ttl 2 s)
    cluster.wait_members(2, on=("a", "c"), timeout_s=6)
    stop.set()
    t.join(10)
    assert not errors
    assert cluster.counters("a")["pushes_dropped"] > dropped_before  # pushes to the dead b, dropped, counted
    # after b left, its share of new puts goes to the two live nodes only
    key = b"after-b"
    a.put_many(ns, [key], [b"z" * 1000])
    cluster.wait_pushes("a")
    owner = cluster.owner(ns, key, alive=("a", "c"))
    assert cluster.clients[owner].exists(ns, [key]) == [True]
