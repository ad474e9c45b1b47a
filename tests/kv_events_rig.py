"""A scripted workload against a real daemon with its vLLM-format KV events on, read over a real ZMQ socket.

Shared by tests/test_kv_events.py (decoded by kvstore's decoder, both encodings) and
tests/vllm_sched/test_vllm_kv_events.py (decoded by vLLM 0.33's own classes). `scenario` returns every frame the
subscriber received for the scenario's topic, in order, and the events it expects (as `norm` writes them), so a
test decodes the same bytes its own way and compares exactly.

ZMQ's subscriptions reach the publisher asynchronously (a PUB drops what it publishes before it has seen a
subscription): `Subscriber.live` stores sentinel blocks in a namespace of its own until one arrives.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvstore.client import BlockOrigin, Client
from kvstore.testing import DaemonProcess, free_port, wait_until

NS, WARM = "kvev/ns", "kvev/warm"
MODEL = "tiny-llama"
BLOCK = 4           # vLLM's block size in these tests (tokens per hash)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Frame = tuple[bytes, int, bytes]   # topic, sequence, payload


def vllm_hash(i: int) -> bytes:
    """A stand-in for vLLM's 32-byte sha256 block hash of block i (the real ones: vllm_sched's tests)."""
    return bytes([i % 256]) * 31 + b"h"


def origins(first: int, n: int, lora: str | None = None) -> list[BlockOrigin]:
    """A chain of blocks first .. first+n-1, one vLLM block per key, BLOCK tokens each."""
    return [BlockOrigin.of([vllm_hash(i)], vllm_hash(i - 1) if i else None, [1000 + i] * BLOCK, BLOCK, lora)
            for i in range(first, first + n)]


def daemon_options(tmp_path: Any, disk: bool = True, **extra: object) -> dict[str, object]:
    port, replay = free_port(), free_port()
    opts: dict[str, object] = {"kv_events": True, "kv_events_endpoint": f"tcp://127.0.0.1:{port}",
                               "kv_events_replay_endpoint": f"tcp://127.0.0.1:{replay}", "arena_bytes": "64MiB",
                               "max_block_bytes": "1MiB"}
    if disk:
        # write-behind (disk_write = commit): the scenario's sequence has each block's disk copy right after its put
        opts.update(disk_bytes="16MiB", disk_segment_bytes="2MiB", disk_dir=str(tmp_path / "disk"), disk_sync="none",
                    disk_write="commit")
    return {**opts, **extra}


def topic(d: DaemonProcess, model: str = MODEL) -> bytes:
    return f"kv@{d.node_id}@{model}".encode()


class Subscriber:
    """A SUB socket on the daemon's endpoint; `frames` keeps what arrived, per topic, in order."""

    def __init__(self, ctx: zmq.Context, endpoint: str, prefixes: tuple[bytes, ...] = (b"",),
                 decode: Callable[[bytes], list[Any]] | None = None, **opts: int) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        for k, v in opts.items():
            self.sock.setsockopt(getattr(zmq, k), v)
        self.sock.connect(endpoint)
        for p in prefixes:
            self.sock.setsockopt(zmq.SUBSCRIBE, p)
        self.decode = decode
        self.frames: list[Frame] = []

    def live(self, client: Client, warm_topic: bytes) -> None:
        """Store sentinels until one is received: the subscription is in place from then on."""
        client.register_namespace(WARM, model="warm")
        for i in itertools.count():
            client.put(WARM, b"sentinel%d" % i, b"s")
            if self.sock.poll(200):
                self.take_all(0)
                if any(t == warm_topic for t, _, _ in self.frames):
                    self.frames = [f for f in self.frames if f[0] != warm_topic]
                    return
            assert i < 100, "no event reached the subscriber"

    def take_all(self, timeout_ms: int) -> None:
        while self.sock.poll(timeout_ms):
            t, seq, payload = self.sock.recv_multipart()
            self.frames.append((t, int.from_bytes(seq, "big"), payload))
            timeout_ms = 0

    def events(self, of_topic: bytes) -> list[Any]:
        assert self.decode is not None
        return [e for t, _, p in self.frames if t == of_topic for e in self.decode(p)]

    def wait_events(self, of_topic: bytes, n: int, timeout_s: float = 20.0) -> list[Any]:
        """Read until the topic's frames hold at least n events; exactly those events so far."""
        deadline = time.monotonic() + timeout_s
        while len(self.events(of_topic)) < n:
            assert time.monotonic() < deadline, f"{len(self.events(of_topic))} of {n} events: {self.events(of_topic)}"
            self.take_all(100)
        return self.events(of_topic)

    def close(self) -> None:
        self.sock.close()


def replay(ctx: zmq.Context, endpoint: str, body: list[bytes], timeout_ms: int = 10000) -> list[list[bytes]]:
    """A request on the replay socket, as vLLM's (a DEALER with the empty delimiter, which a REQ would add: a REQ
    takes one reply, a replay sends many); every reply until the end marker, delimiter stripped."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", *body])
        out = []
        while True:
            assert s.poll(timeout_ms), f"no end marker after {out}"
            msg = s.recv_multipart()
            assert msg[0] == b"", msg
            out.append(msg[1:])
            if msg[1:] == [b"", END_SEQ, b""]:
                return out
    finally:
        s.close()


def scenario(d: DaemonProcess, sub: Subscriber, norm: Callable[[Any], tuple]) -> list[tuple]:
    """put (3 annotated + 1 plain) -> disk writes -> demote (an eviction to disk) -> get (a promotion) -> delete ->
    clear, each step's events read before the next; the topic's normalized events, in order."""
    t = topic(d)
    h = vllm_hash
    tok = [1000 + i for i in range(3) for _ in range(BLOCK)]
    with d.client() as c:
        sub.live(c, topic(d, "warm"))
        c.register_namespace(NS, model=MODEL, tokens_per_block=BLOCK)
        assert c.annotate(NS, [b"k0", b"k1", b"k2"], origins(0, 3)) == 3
        c.put_many(NS, [b"k0", b"k1", b"k2"], [b"a" * 4096] * 3)
        got = sub.wait_events(t, 4)  # RAM: one event for the put; disk: one per written block
        c.put(NS, b"plain", b"p" * 4096)  # no identity: published under its key, flagged
        wait_until(lambda: c.stats().disk.write_queue_blocks == 0, what="write-behind")
        got = sub.wait_events(t, 6)
        assert c.hint(NS, [b"k1"], "demote") == ["accepted"]  # the RAM copy goes; the disk keeps k1
        assert c.get(NS, b"k1") == b"a" * 4096                # a promotion back into RAM
        assert c.delete(NS, [b"k2"]) == 1
        got = sub.wait_events(t, 10)
        c.clear(NS)
        got = [norm(e) for e in sub.wait_events(t, 14)]
        sub.take_all(300)  # nothing more may come
        assert len(sub.events(t)) == 14, sub.events(t)
    key = ("kvstore-key",)
    want = [
        ("stored", "CPU", (h(0), h(1), h(2)), None, tuple(tok), BLOCK, None, "kvstore"),
        ("stored", "STORAGE", (h(0),), None, tuple(tok[0:4]), BLOCK, None, "kvstore"),
        ("stored", "STORAGE", (h(1),), h(0), tuple(tok[4:8]), BLOCK, None, "kvstore"),
        ("stored", "STORAGE", (h(2),), h(1), tuple(tok[8:12]), BLOCK, None, "kvstore"),
        ("stored", "CPU", (b"plain",), None, (), 0, None, *key),
        ("stored", "STORAGE", (b"plain",), None, (), 0, None, *key),
        ("removed", "CPU", (h(1),), "kvstore"),                                 # demote: evicted to disk
        ("stored", "CPU", (h(1),), h(0), tuple(tok[4:8]), BLOCK, None, "kvstore"),  # promoted
        ("removed", "CPU", (h(2),), "kvstore"),                                 # delete: RAM, then disk
        ("removed", "STORAGE", (h(2),), "kvstore"),
    ]
    assert got[:10] == want, got[:10]
    # clear: each RAM block leaves (in the namespace's order), then AllBlocksCleared: the topic holds nothing
    assert sorted(got[10:13]) == sorted([("removed", "CPU", (h(0),), "kvstore"), ("removed", "CPU", (h(1),), "kvstore"),
                                         ("removed", "CPU", (b"plain",), *key)])
    assert got[13] == ("cleared",)
    return got
