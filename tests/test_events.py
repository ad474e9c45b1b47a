"""KV events over the real Subscribe stream: the exact sequence for a scripted workload, and slow consumers."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest

from kvstore import StoreFullError
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import KVEvent
from kvstore.engine.events import EventBus
from kvstore.testing import wait_until

NS = "ev/ns"
MiB = 1 << 20


def _collect(stream, out: queue.Queue) -> threading.Thread:
    def run() -> None:
        for ev in stream:
            out.put(ev)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _take(q: queue.Queue, n: int) -> list[KVEvent]:
    return [q.get(timeout=15) for _ in range(n)]


def _summary(events: list[KVEvent]) -> list[tuple]:
    return [(e.kind, e.namespace, e.keys, e.tier, e.to_tier) for e in events]


def test_exact_sequence_for_put_evict_promote_delete(make_daemon, tmp_path) -> None:
    d = make_daemon(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                    disk_bytes="16MiB", disk_segment_bytes="2MiB", disk_dir=str(tmp_path / "disk"), disk_sync="none", disk_write="commit")
    got: queue.Queue = queue.Queue()
    with d.client() as c, c.subscribe([NS]) as stream:
        _collect(stream, got)
        wait_until(lambda: d.client().health() is not None, what="subscriber")  # the stream is open
        c.register_namespace(NS)
        c.register_namespace("ev/other")
        c.put("ev/other", b"x", b"not for us")  # filtered out by the namespace subscription
        # put a, b, c, d (1 MiB each: the arena is full), each written behind to disk
        for k in (b"a", b"b", b"c", b"d"):
            c.put(NS, k, k * MiB)
            wait_until(lambda: c.stats().disk.write_queue_blocks == 0, what="write-behind")
        first = _take(got, 8)
        assert _summary(first) == [
            ("stored", NS, (b"a",), "ram", ""), ("stored", NS, (b"a",), "disk", ""),
            ("stored", NS, (b"b",), "ram", ""), ("stored", NS, (b"b",), "disk", ""),
            ("stored", NS, (b"c",), "ram", ""), ("stored", NS, (b"c",), "disk", ""),
            ("stored", NS, (b"d",), "ram", ""), ("stored", NS, (b"d",), "disk", ""),
        ]
        # put e -> evicts a (LRU), which the disk keeps: a moves ram -> disk; e stored in ram then disk
        c.put(NS, b"e", b"e" * MiB)
        wait_until(lambda: c.stats().disk.write_queue_blocks == 0, what="write-behind")
        # get a -> promotion evicts b (moves ram -> disk) and brings a back (disk -> ram)
        assert c.get(NS, b"a") == b"a" * MiB
        # delete c: removed from ram and from disk
        assert c.delete(NS, [b"c"]) == 1
        rest = _take(got, 7)
        assert _summary(rest) == [
            ("moved", NS, (b"a",), "ram", "disk"),
            ("stored", NS, (b"e",), "ram", ""),
            ("stored", NS, (b"e",), "disk", ""),
            ("moved", NS, (b"b",), "ram", "disk"),
            ("moved", NS, (b"a",), "disk", "ram"),
            ("removed", NS, (b"c",), "ram", ""),
            ("removed", NS, (b"c",), "disk", ""),
        ]
        seqs = [e.seq for e in first + rest]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert {e.node_id for e in first + rest} == {d.node_id}
        assert got.empty()


def test_stalled_subscriber_does_not_block_puts_and_sees_a_gap(make_daemon) -> None:
    d = make_daemon(arena_bytes="256MiB", max_block_bytes="1MiB")
    # BDP probing off: the HTTP/2 window stays at its initial 64 KiB, so a reader that stops reading really
    # stalls the stream (otherwise gRPC would soak megabytes into its own buffers first)
    ch = grpc.insecure_channel(d.address, options=[("grpc.http2.bdp_probe", 0)])
    call = pb_grpc.KVStoreStub(ch).Subscribe(pb.SubscribeRequest(buffer=5))
    with ch, d.client() as c:
        c.register_namespace(NS)
        it = (KVEvent.from_pb(m) for m in call)
        c.put(NS, b"k0", b"v")
        assert next(it).keys == (b"k0",)  # the stream is live
        # nobody reads now. Each batch is one event of 1000 x 64-byte keys (~66 KB), so 60 of them overflow
        # gRPC's transport buffers and the subscriber's 5-event buffer; the puts must not wait for it.
        t0 = time.monotonic()
        for b in range(60):
            keys = [b"%03d" % b + bytes([i % 256, i // 256]) * 30 + b"_" for i in range(1000)]
            assert c.put_many(NS, keys, [b"v"] * 1000).stored == 1000
        assert time.monotonic() - t0 < 60
        assert c.stats().blocks == 60001
        c.put(NS, b"after", b"v")  # published while the buffer is still full: it may be lost too
        delivered = gaps = dropped = 0
        for ev in it:
            if ev.kind == "gap":
                gaps += 1
                dropped += ev.dropped
                c.put(NS, b"final", b"v")  # the reader is caught up now: this one must arrive
                continue
            if ev.keys == (b"final",):
                break
            delivered += 1
            assert len(ev.keys) == 1000 or ev.keys == (b"after",)
        # every one of the 61 events (60 batches + "after") was either delivered or counted in a gap
        assert gaps == 1 and dropped > 0
        assert delivered + dropped == 61
        call.cancel()


def test_subscriber_limit(make_daemon) -> None:
    d = make_daemon(max_subscribers=1)
    with d.client() as c, c.subscribe() as first:
        c.register_namespace(NS)
        it1 = iter(first)
        c.put(NS, b"x", b"1")
        assert next(it1).keys == (b"x",)
        with c.subscribe() as second, pytest.raises(StoreFullError, match="max_subscribers=1"):
            next(iter(second))


def test_bus_gap_sits_where_events_were_lost() -> None:
    bus = EventBus()
    sub = bus.subscribe(capacity=3)
    for i in range(6):  # e1 e2 e3 fit; e4 e5 e6 are lost
        bus.publish("stored", "n", [b"%d" % i], 1)
    assert bus.dropped_total == 3
    assert [sub.next(0).keys for _ in range(2)] == [(b"0",), (b"1",)]
    bus.publish("stored", "n", [b"late"], 1)  # room again: the gap goes before it
    out = [sub.next(0) for _ in range(3)]
    assert [(e.kind, e.keys, e.dropped) for e in out] == [
        ("stored", (b"2",), 0), ("gap", (), 3), ("stored", (b"late",), 0)]
    assert sub.next(0) is None


def test_kvstore_events_cli_tails_the_stream(make_daemon) -> None:
    import json
    import subprocess
    import sys

    d = make_daemon()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "--address", d.address, "events",
                             "--json", "--count", "2", "--namespace", NS], stdout=subprocess.PIPE, text=True)
    with d.client() as c:
        c.register_namespace(NS)
        wait_until(lambda: c.stats() is not None and _subscribed(d), what="the CLI to subscribe")
        c.put(NS, b"cli-1", b"v")
        c.delete(NS, [b"cli-1"])
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    docs = [json.loads(line) for line in out.splitlines()]
    assert [(x["kind"], x["tier"], x["namespace"], [k["key"] for k in x["keys"]]) for x in docs] == [
        ("stored", "ram", NS, [b"cli-1".hex()]), ("removed", "ram", NS, [b"cli-1".hex()])]


def _subscribed(d) -> bool:
    """The daemon has one more RPC in flight than a bare client would: poll the subscriber count via metrics."""
    import urllib.request

    with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return "kvstore_event_subscribers 1.0" in text
