"""Deadlines on the UCX peer data plane (over UCX's tcp transport here): a push whose block never comes is cut
at the deadline and the late block never lands, an idle endpoint is closed, a peer that answers a header and
stalls costs a fetch its deadline. In-process nodes (tests/peer_rig.py); the byte patterns and helpers:
tests/peer_deadline_helpers.py. Skipped without ucxx.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kvstore.peer import frames as fr
from kvstore.peer.membership import Member
from kvstore.peer.plane import PeerTimeout
from tests.peer_deadline_helpers import C3, D4, SLACK, nodes_fixture, push_frame
from tests.peer_helpers import ucx_available
from tests.peer_rig import BLOCK, NS, Node, addr

pytestmark = pytest.mark.timeout(120)
nodes = nodes_fixture()


# -- the UCX plane (over UCX's tcp transport here) ----------------------------------------------------------
needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx not installed (pip install ucxx-cu12)")


def on_loop(node: Node, coro, timeout_s: float = 20.0):
    """Run a coroutine on the node's UCX event loop (ucxx endpoints belong to the loop that made them)."""
    return asyncio.run_coroutine_threadsafe(coro, node.plane._loop).result(timeout_s)  # noqa: SLF001


def u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


async def poll(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@needs_ucx
@pytest.mark.parametrize("timeout_s, ttl_s, fired, other, at", [
    (1.0, 30.0, "frame_deadline_exceeded", "slot_deadline_exceeded", 1.0),   # the frame's deadline comes first
    (3.0, 1.0, "slot_deadline_exceeded", "frame_deadline_exceeded", 0.5),    # the reservation's safe end does
])
def test_ucx_a_push_whose_block_never_comes_is_cut_at_the_deadline_and_the_late_block_never_lands(
        nodes, timeout_s: float, ttl_s: float, fired: str, other: str, at: float) -> None:
    import ucxx
    b = nodes("b", plane="ucx", timeout_s=timeout_s, reservation_ttl_s=ttl_s)
    host, port = addr(b)
    frame = push_frame(b"stall")

    async def attack() -> float:
        ep = await ucxx.create_endpoint(host, port)
        await ep.send(u8(frame[:fr.HEADER.size]))
        await ep.send(u8(frame[fr.HEADER.size:]))          # header and metadata; the block is withheld
        start = time.monotonic()
        await poll(lambda: b.counters.get(fired) == 1, 5, fired)
        cut = time.monotonic() - start
        try:                                               # the block, late: the endpoint is gone
            await asyncio.wait_for(ep.send(u8(bytes([C3]) * BLOCK)), 1.0)
        except Exception:  # noqa: BLE001 - refused or timed out: either way it must not land
            pass
        ep.abort()
        return cut

    cut = on_loop(b, attack())
    assert at - 0.05 <= cut <= at + SLACK, cut
    assert b.counters.get(other) == 0
    active, reserved_bytes, c = b.stats()
    assert (active, reserved_bytes, c["reserved_blocks"], c["aborted_blocks"], c["committed_blocks"],
            c["reservation_expirations"]) == (0, 0, 1, 1, 0, 0)
    assert int(np.count_nonzero(b.view == C3)) == 0
    b.put(b"next-owner", bytes([D4]) * BLOCK)                # the freed slot's next owner reads back its own bytes
    assert b.read(b"next-owner") == bytes([D4]) * BLOCK
    assert int(np.count_nonzero(b.view == C3)) == 0


@needs_ucx
def test_ucx_an_idle_endpoint_is_closed_after_the_idle_timeout(nodes) -> None:
    import ucxx
    b = nodes("b", plane="ucx", idle_timeout_s=0.5)
    host, port = addr(b)

    async def idle() -> float:
        ep = await ucxx.create_endpoint(host, port)
        start = time.monotonic()
        await poll(lambda: b.counters.get("idle_closed") == 1, 5, "the idle timeout")
        ep.abort()
        return time.monotonic() - start

    took = on_loop(b, idle())
    assert took <= 0.5 + SLACK, took


@needs_ucx
def test_ucx_a_peer_that_answers_a_header_and_stalls_costs_a_fetch_its_deadline(nodes) -> None:
    import ucxx
    a = nodes("a", plane="ucx", timeout_s=1.0)
    keys = [b"u1", b"u2", b"u3"]
    answered = threading.Event()

    async def stalling_peer(ep) -> None:
        raw = np.empty(fr.HEADER.size, dtype=np.uint8)
        await ep.recv(raw)
        h = fr.check_header(raw.tobytes(), max_keys=64, max_block_bytes=1 << 20)
        await ep.recv(np.empty(h.meta_len, dtype=np.uint8))
        table = fr.encode_sizes(np.full(h.count, BLOCK), np.zeros(h.count, dtype=np.uint64))
        await ep.send(u8(fr.Header(fr.FETCH_REPLY, h.request_id, h.count, len(table), h.count * BLOCK).pack()))
        await ep.send(u8(table))
        answered.set()                                    # and never sends a block, holding the endpoint open
        await hold.wait()

    async def listen():
        return asyncio.Event(), ucxx.create_listener(stalling_peer)

    hold, listener = on_loop(a, listen())
    try:
        member = Member("f", "", f"127.0.0.1:{listener.port}", "ucx", 0)
        start = time.monotonic()
        with pytest.raises(PeerTimeout):
            a.plane.fetch(member, NS, keys)
        took = time.monotonic() - start
    finally:
        a.plane._loop.call_soon_threadsafe(hold.set)  # noqa: SLF001
        on_loop(a, _close_listener(listener))
    assert answered.is_set()
    assert 1.0 - 0.05 <= took <= 1.0 + SLACK, took
    assert a.counters.get("frame_deadline_exceeded") == 1
    active, reserved_bytes, c = a.stats()
    assert (active, reserved_bytes, c["reserved_blocks"], c["aborted_blocks"], c["committed_blocks"]) == (0, 0, 3, 3, 0)


async def _close_listener(listener) -> None:
    listener.close()
