"""Deadlines on the peer data plane: a slow peer cannot hold a frame, a slot or the listener.

In-process nodes (tests/peer_rig.py: a real engine, a real LocalStore, a real TcpPlane on loopback) let these
tests scan the receiving arena byte by byte and count reservations exactly; the last test runs the same
attacks against a real daemon pair over etcd. The attacker is always a raw socket speaking the real frames.
The same deadlines on the UCX plane: test_peer_deadlines_ucx.py; the byte patterns (0xA1 honest, 0xB2 trickled
while live, 0xC3 after the cutoff, 0xD4 the slot's next owner) and helpers: tests/peer_deadline_helpers.py.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import ExitStack

import numpy as np
import pytest

from kvstore.peer import frames as fr
from kvstore.peer.placement import rank
from kvstore.peer.remote_tier import RemoteTier
from kvstore.peer.tcp_plane import MAX_CONNECTIONS
from kvstore.testing import wait_until
from tests.peer_deadline_helpers import (
    A1, B2, C3, D4, HALF, SLACK, StallingPeer, Trickler, nodes_fixture, push_frame, recv_n, slot_of,
)
from tests.peer_helpers import Cluster, needs_etcd, register
from tests.peer_rig import BLOCK, NS, addr, closed_by_peer, still_open

pytestmark = pytest.mark.timeout(120)
nodes = nodes_fixture()


# -- the receiving side of a frame ----------------------------------------------------------------------------
def test_slow_loris_push_is_cut_at_the_frame_deadline_and_nothing_lands_after_it(nodes) -> None:
    b = nodes("b", timeout_s=1.0)
    with socket.create_connection(addr(b)) as s:
        start = time.monotonic()
        s.sendall(push_frame(b"loris") + bytes([A1]) * HALF)   # header, meta, half the block: honest
        t = Trickler(s, B2)                                   # then 20 bytes/s: the rest would take 27 min
        t.start()
        closed = closed_by_peer(s, 5)
        t.pattern = C3                                        # after the cutoff: a pattern that must not land
        t.halt.wait(0.3)
        t.stop()
    assert closed is not None and 1.0 - 0.05 <= closed - start <= 1.0 + SLACK, closed and closed - start
    # the reservation was aborted at the deadline: nothing reserved, nothing committed, nothing expired
    active, reserved_bytes, c = b.stats()
    assert (active, reserved_bytes) == (0, 0)
    assert (c["reserved_blocks"], c["aborted_blocks"], c["committed_blocks"], c["reservation_expirations"]) == (1, 1, 0, 0)
    assert b.read(b"loris") is None
    pc = b.counters.snapshot()
    assert (pc["frame_deadline_exceeded"], pc["frame_errors"], pc["received_pushes"]) == (1, 0, 0)
    # the arena: the honest half, then the trickled bytes received before the deadline, then zeros; no 0xC3
    off = slot_of(b)
    trickled = int(np.count_nonzero(b.view == B2))
    assert 1 <= trickled <= t.sent[B2]
    assert (b.view[off + HALF: off + HALF + trickled] == B2).all()
    assert not b.view[off + HALF + trickled: off + BLOCK].any()
    assert int(np.count_nonzero(b.view == C3)) == 0
    # the slot was freed at once (not left to TTL and quarantine): its next owner gets it and reads it back exactly
    assert b.put(b"next-owner", bytes([D4]) * BLOCK) == off
    assert b.read(b"next-owner") == bytes([D4]) * BLOCK


def test_a_reservation_shorter_than_the_frame_deadline_stops_the_writes_into_its_slot(nodes) -> None:
    """reservation_ttl_s 1 s, frame deadline 3 s: the slot is let go at the reservation's safe end (0.5 s
    after the reserve), handed to a new owner, and the bytes the loris sends afterwards go to scratch."""
    b = nodes("b", timeout_s=3.0, reservation_ttl_s=1.0)
    with socket.create_connection(addr(b)) as s:
        s.sendall(push_frame(b"loris") + bytes([A1]) * HALF)
        sent_meta = time.monotonic()
        t = Trickler(s, B2)
        t.start()
        wait_until(lambda: b.counters.get("slot_deadline_exceeded") == 1, 5, 0.01, "the slot's safe end")
        cut = time.monotonic() - sent_meta
        t.pattern = C3
        assert 0.5 - 0.05 <= cut <= 1.0, cut                  # before the reservation could expire
        active, reserved_bytes, c = b.stats()
        assert (active, reserved_bytes, c["aborted_blocks"], c["reservation_expirations"]) == (0, 0, 1, 0)
        off = slot_of(b)
        assert b.put(b"next-owner", bytes([D4]) * BLOCK) == off   # the very slot the loris was writing into
        t.halt.wait(0.3)                                          # the loris keeps trickling into the frame
        t.stop()
        rest = BLOCK - HALF - t.sent[B2] - t.sent[C3]
        s.sendall(bytes([C3]) * rest)                             # and finishes it before the frame deadline
        h = fr.check_header(recv_n(s, fr.HEADER.size), max_keys=64, max_block_bytes=1 << 20)
        assert (h.op, h.request_id, h.count) == (fr.PUSH_REPLY, 7, 0)   # stored nothing; connection in step
        meta = fr.encode_fetch(NS, [b"next-owner", b"loris"])
        s.sendall(fr.Header(fr.PROBE, 8, 2, len(meta), 0).pack() + meta)
        assert recv_n(s, fr.HEADER.size + 2)[-2:] == b"\x01\x00"
    assert b.read(b"next-owner") == bytes([D4]) * BLOCK
    assert int(np.count_nonzero(b.view == C3)) == 0
    pc = b.counters.snapshot()
    assert (pc["slot_deadline_exceeded"], pc["frame_deadline_exceeded"], pc["frame_errors"], pc["received_pushes"]) \
        == (1, 0, 0, 0)


# -- the listener ------------------------------------------------------------------------------------------
def test_65_idle_connections_do_not_lock_out_a_real_fetch(nodes) -> None:
    a, b = nodes("a"), nodes("b")
    value = os.urandom(BLOCK)
    b.put(b"k", value)
    socks = [socket.create_connection(addr(b)) for _ in range(MAX_CONNECTIONS + 1)]
    try:
        # the 65th connection evicted the longest idle one (the first) instead of being refused
        assert closed_by_peer(socks[0], 5) is not None
        assert b.counters.get("idle_evicted") == 1
        assert a.plane.fetch(b.member, NS, [b"k"]) == 1           # a real peer gets in: the second one goes
        assert a.read(b"k") == value
        assert closed_by_peer(socks[1], 5) is not None
        assert all(still_open(s) for s in socks[2:])
        assert (b.counters.get("idle_evicted"), b.counters.get("conn_refused")) == (2, 0)
        assert len(b.plane.server.conns) == MAX_CONNECTIONS
    finally:
        for s in socks:
            s.close()


def test_a_listener_full_of_frames_in_progress_refuses_until_their_deadline(nodes) -> None:
    b = nodes("b", timeout_s=1.0, max_connections=2)
    busy = [socket.create_connection(addr(b)) for _ in range(2)]
    for s in busy:
        s.sendall(push_frame(b"x")[:10])                      # a header started: busy, not idle
    wait_until(lambda: b.plane.server.conns.counts() == (0, 2), 5, 0.01, "two busy connections")
    with socket.create_connection(addr(b)) as third:
        assert closed_by_peer(third, 5) is not None           # refused: nobody idle to evict
    assert b.counters.get("conn_refused") == 1
    for s in busy:                                            # the busy ones go at their frame deadline
        assert closed_by_peer(s, 1.0 + SLACK) is not None
        s.close()
    assert (b.counters.get("frame_deadline_exceeded"), b.counters.get("idle_evicted")) == (2, 0)
    with socket.create_connection(addr(b)) as s:              # and the listener takes new connections again
        meta = fr.encode_fetch(NS, [b"x"])
        s.sendall(fr.Header(fr.PROBE, 1, 1, len(meta), 0).pack() + meta)
        assert recv_n(s, fr.HEADER.size + 1)[-1:] == b"\x00"


def test_idle_connections_close_after_the_idle_timeout_and_the_client_pool_redials(nodes) -> None:
    a = nodes("a")                                   # a's pool would keep a connection for 30 s (idle 60 s / 2)
    b = nodes("b", idle_timeout_s=0.5)
    value = os.urandom(BLOCK)
    b.put(b"k", value)
    with socket.create_connection(addr(b)) as s:
        start = time.monotonic()
        closed = closed_by_peer(s, 5)
    assert closed is not None and 0.5 - 0.05 <= closed - start <= 0.5 + SLACK
    assert b.counters.get("idle_closed") == 1
    assert a.plane.fetch(b.member, NS, [b"k"]) == 1  # leaves a pooled connection on a
    wait_until(lambda: b.counters.get("idle_closed") == 2, 5, 0.02, "b to close a's idle connection")
    assert a.engine.delete(NS, [b"k"]) == 1
    assert a.plane.fetch(b.member, NS, [b"k"]) == 1  # the pool saw its connection closed and dialled again
    assert a.read(b"k") == value
    assert b.counters.get("frame_errors") == 0


# -- the fetching side -------------------------------------------------------------------------------------
def test_a_peer_that_answers_a_header_and_stalls_costs_a_fetch_its_deadline_and_the_keys_are_misses(nodes) -> None:
    a = nodes("a", timeout_s=1.0)
    f = StallingPeer()
    f.start()
    members = {"a": a.member, "f": f.member}
    keys = [k for k in (b"s%d" % i for i in range(64)) if rank(NS, k, ["a", "f"])[0] == "f"][:3]
    tier = RemoteTier(a.engine, a.plane, lambda: members, "a", copies=1, timeout_s=1.0, max_keys=64,
                      counters=a.counters)
    try:
        start = time.monotonic()
        assert tier.fill(NS, keys).stored == 0
        took = time.monotonic() - start
    finally:
        tier.close()
    assert 1.0 - 0.05 <= took <= 1.0 + SLACK, took
    assert f.hung_up.wait(5)
    pc = a.counters.snapshot()
    assert (pc["fetch_calls"], pc["timeouts"], pc["fetch_misses"], pc["fetched_blocks"], pc["errors"]) == (1, 1, 3, 0, 0)
    assert pc["frame_deadline_exceeded"] == 1
    active, reserved_bytes, c = a.stats()
    assert (active, reserved_bytes, c["reserved_blocks"], c["aborted_blocks"], c["committed_blocks"]) == (0, 0, 3, 3, 0)
    assert a.engine.exists(NS, keys) == [False] * 3


# -- a real daemon pair ---------------------------------------------------------------------------------------
@needs_etcd
def test_daemons_cut_a_slow_loris_and_keep_serving_past_65_idle_sockets() -> None:
    with ExitStack() as stack:
        cluster = Cluster(stack, names=("a", "b"), timeout_s=1.0)
        ns = NS
        register(cluster.clients, ns)
        a, b = cluster.clients["a"], cluster.clients["b"]
        host, _, port = b.health().peers.data_address.rpartition(":")
        before, engine_before = cluster.counters("b"), b.stats().counters
        with socket.create_connection((host, int(port))) as s:
            start = time.monotonic()
            s.sendall(push_frame(b"loris") + bytes([A1]) * HALF)
            t = Trickler(s, B2)
            t.start()
            closed = closed_by_peer(s, 5)
            t.stop()
        assert closed is not None and 1.0 - 0.05 <= closed - start <= 1.0 + SLACK
        after, st = cluster.counters("b"), b.stats()
        assert after["frame_deadline_exceeded"] - before["frame_deadline_exceeded"] == 1
        assert (st.reservations_active, st.reserved_bytes) == (0, 0)
        assert st.counters["aborted_blocks"] - engine_before["aborted_blocks"] == 1
        assert st.counters["committed_blocks"] == engine_before["committed_blocks"]
        assert b.exists(ns, [b"loris"]) == [False]
        # 65 idle sockets on b, then a reads a block only b holds
        key = next(k for k in (b"own%d" % i for i in range(100)) if cluster.owner(ns, k) == "b")
        value = os.urandom(300_000)
        b.put_many(ns, [key], [value])
        a_before = cluster.counters("a")
        socks = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS + 1)]
        try:
            # at least the 65th socket found b full and evicted the longest idle connection (a's pooled ones
            # from the pushes, if any, go first: they are older)
            wait_until(lambda: cluster.counters("b")["idle_evicted"] > after["idle_evicted"], 5, 0.02,
                       "b to evict an idle connection")
            assert a.get_many(ns, [key]) == [value]
            a_after = cluster.counters("a")
            assert (a_after["fetched_blocks"] - a_before["fetched_blocks"], a_after["errors"] - a_before["errors"],
                    a_after["timeouts"] - a_before["timeouts"]) == (1, 0, 0)
            assert cluster.counters("b")["conn_refused"] == before["conn_refused"]
        finally:
            for s in socks:
                s.close()
        assert all(d.proc.poll() is None for d in cluster.nodes.values())
