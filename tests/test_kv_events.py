"""The daemon's vLLM-format KV events (kv_events) over a real ZMQ socket: exact sequences, replay, bad input.

The same scenario decoded by vLLM 0.33's own classes: tests/vllm_sched/test_vllm_kv_events.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import BlockOrigin, Client
from kvstore.engine.events import STORED, EventBus
from kvstore.errors import ConfigError, InvalidRequestError, UnknownNamespaceError
from kvstore.server.config import load_config
from kvstore.server.kv_events.config import KvEventsConfig
from kvstore.server.kv_events.encoding import decode_batch, encode_batch
from kvstore.server.kv_events.publisher import KvEventsPublisher
from kvstore.server.kv_events.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.testing import DaemonProcess, free_port, wait_until
from kvstore.vocab import Tier
from tests.kv_events_rig import (BLOCK, MODEL, NS, Subscriber, daemon_options, origins, replay, scenario, topic,
                                 vllm_hash)

BASE = ["--unix-socket", "/tmp/kvstore-kvev-test.sock", "--disk-dir", "/tmp/kvstore-kvev-test-disk"]


def events_of(payload: bytes) -> list:
    return decode_batch(payload)[1]


def norm(e: object) -> tuple:
    if isinstance(e, BlockStored):
        return ("stored", e.medium, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_name,
                e.ownership)
    if isinstance(e, BlockRemoved):
        return ("removed", e.medium, e.block_hashes, e.ownership)
    assert isinstance(e, AllBlocksCleared), e
    return ("cleared",)


@pytest.fixture()
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.term()


def kv_metrics(d: DaemonProcess) -> dict[str, float]:
    text = httpx.get(d.metrics_url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("kvstore_kv_events_")}


# -- the encoding -------------------------------------------------------------------------------------------
def test_the_batch_is_vllm_033s_map_form_and_the_decoder_reads_both_encodings() -> None:
    stored = BlockStored((b"h1", b"h2"), b"h0", (1, 2, 3, 4), 2, "CPU", "lora-a")
    batch = encode_batch(12.5, [stored, BlockRemoved((b"h1",), "STORAGE"), AllBlocksCleared()])
    assert msgpack.unpackb(batch) == [12.5, [
        {"type": "BlockStored", "block_hashes": [b"h1", b"h2"], "parent_block_hash": b"h0", "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": None, "medium": "CPU", "lora_name": "lora-a", "ownership": "kvstore"},
        {"type": "BlockRemoved", "block_hashes": [b"h1"], "medium": "STORAGE", "ownership": "kvstore"},
        {"type": "AllBlocksCleared"}], None]
    assert decode_batch(batch) == (12.5, [stored, BlockRemoved((b"h1",), "STORAGE", "kvstore"), AllBlocksCleared()])
    # the array form older vLLMs emitted: [ts, [[tag, fields...], ...](, dp rank)]
    arrays = msgpack.packb([3.0, [["BlockStored", [b"h1"], None, [7, 8], 2, None, "GPU"],
                                  ["BlockRemoved", [b"h1"], "GPU"], ["AllBlocksCleared"]], 0])
    assert decode_batch(arrays) == (3.0, [BlockStored((b"h1",), None, (7, 8), 2, "GPU", None, ""),
                                          BlockRemoved((b"h1",), "GPU", ""), AllBlocksCleared()])
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [{"type": "Nope"}]])):
        with pytest.raises(ValueError):
            decode_batch(bad)


# -- a real daemon --------------------------------------------------------------------------------------------
def test_exact_sequence_put_evict_to_disk_promote_delete_clear(make_daemon, tmp_path, ctx) -> None:
    d = make_daemon(**daemon_options(tmp_path))
    sub = Subscriber(ctx, d.args[d.args.index("--kv-events-endpoint") + 1], decode=events_of)
    try:
        scenario(d, sub, norm)
        seqs = [s for t, s, _ in sub.frames if t == topic(d)]
        assert seqs == list(range(len(seqs)))  # one sequence per topic, from 0, no gap
    finally:
        sub.close()


def test_replay_after_a_missed_range(make_daemon, tmp_path, ctx) -> None:
    """One topic for everything (kv_events_topic = "", vLLM's default): vLLM's 8-byte replay request."""
    opts = daemon_options(tmp_path, disk=False, kv_events_topic="")
    d = make_daemon(**opts)
    live = Subscriber(ctx, str(opts["kv_events_endpoint"]), decode=events_of)
    try:
        with d.client() as c:
            live.live(c, b"")  # the sentinels' batches are the topic's first ones: forgotten here
            c.register_namespace(NS, model=MODEL, tokens_per_block=BLOCK)
            for i in range(6):  # six batches at least: one put, its events read before the next
                c.annotate(NS, [b"k%d" % i], origins(i, 1))
                c.put(NS, b"k%d" % i, b"x" * 4096)
                live.wait_events(b"", i + 1)
        mine = live.frames
        start = mine[2][1]  # a subscriber that missed everything from our third batch on asks for it
        got = replay(ctx, str(opts["kv_events_replay_endpoint"]), [start.to_bytes(8, "big")])
        assert got[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert [(t, int.from_bytes(s, "big"), p) for t, s, p in got[:-1]] == mine[2:]
        assert [norm(e) for _, _, p in got[:-1] for e in events_of(p)] == [
            ("stored", "CPU", (vllm_hash(i),), vllm_hash(i - 1), (1000 + i,) * BLOCK, BLOCK, None, "kvstore")
            for i in range(2, 6)]
        # the same with the topic named: [topic, start]
        named = replay(ctx, str(opts["kv_events_replay_endpoint"]), [b"", (mine[5][1]).to_bytes(8, "big")])
        assert [(t, int.from_bytes(s, "big"), p) for t, s, p in named[:-1]] == mine[5:]
        assert kv_metrics(d)["kvstore_kv_events_replay_requests_total"] == 2
    finally:
        live.close()


def test_bad_replay_requests_and_an_unknown_topic_leave_the_daemon_serving(make_daemon, tmp_path, ctx) -> None:
    opts = daemon_options(tmp_path, disk=False)
    d = make_daemon(**opts)
    ep, rep = str(opts["kv_events_endpoint"]), str(opts["kv_events_replay_endpoint"])
    sub = Subscriber(ctx, ep, decode=events_of)  # everything (for the sentinels)
    odd = Subscriber(ctx, ep, prefixes=(b"nope@", topic(d)), decode=events_of)
    end = [[b"", (-1).to_bytes(8, "big", signed=True), b""]]
    try:
        with d.client() as c:
            sub.live(c, topic(d, "warm"))
            c.register_namespace(NS, model=MODEL)
            c.put(NS, b"k0", b"x")
            sub.wait_events(topic(d), 1)
            for body in ([b"abc"], [b"\x00" * 9], [b"", b"", b"x"], [b"nope@x", (0).to_bytes(8, "big")],
                         [(0).to_bytes(8, "big")]):  # the last: bare, with two topics published
                assert replay(ctx, rep, body) == end, body
            raw = ctx.socket(zmq.DEALER)  # no empty delimiter: nothing can answer it, nothing breaks
            raw.connect(rep)
            raw.send(b"garbage")
            raw.send_multipart([b"", topic(d), (0).to_bytes(8, "big")])  # on the same pipe: read after it
            while raw.recv_multipart()[1:] != [b"", (-1).to_bytes(8, "big", signed=True), b""]:
                pass
            raw.close(linger=0)
            wait_until(lambda: kv_metrics(d)["kvstore_kv_events_unknown_topic_subscriptions_total"] == 1,
                       what="the unknown topic's subscription counted")
            c.put(NS, b"k1", b"y")  # still serving, still publishing, to the right subscribers only
            k0, k1 = (BlockStored((k,), None, (), 0, "CPU", None, "kvstore-key") for k in (b"k0", b"k1"))
            wait_until(lambda: (odd.take_all(0), odd.events(topic(d))[-1:] == [k1])[1], what="k1 at the subscriber")
            assert odd.events(topic(d)) in ([k1], [k0, k1])  # k0 too if its subscription was in place by then
            assert {t for t, _, _ in odd.frames} == {topic(d)}
            assert c.health().status == "SERVING"
        m = kv_metrics(d)
        assert m["kvstore_kv_events_replay_refused_total"] == 6
        assert m["kvstore_kv_events_replay_requests_total"] == 1
        assert replay(ctx, rep, [topic(d), (1).to_bytes(8, "big")])[0][1] == (1).to_bytes(8, "big")
    finally:
        sub.close()
        odd.close()


_STUCK = """
import json, sys, zmq
sub = zmq.Context().socket(zmq.SUB)
sub.setsockopt(zmq.RCVBUF, 1024)   # a small TCP window: a stopped reader stops the stream at once
sub.setsockopt(zmq.RCVHWM, 0)      # and its own queue never drops (libzmq drops at a full SUB queue)
sub.connect(sys.argv[1])
sub.setsockopt(zmq.SUBSCRIBE, b"")
seqs = []
while True:
    topic, seq, _ = sub.recv_multipart()
    if topic.endswith(b"@warm") and not seqs:
        print("ready", flush=True)
        seqs.append(None)
    elif topic.endswith(b"@final"):
        print(json.dumps([s for s in seqs[1:]]), flush=True)
        break
    elif topic.endswith(b"@" + sys.argv[2].encode()):
        seqs.append(int.from_bytes(seq, "big"))
"""


def test_a_subscriber_that_never_reads_costs_it_batches_never_a_put(make_daemon, tmp_path) -> None:
    """A subscriber process stopped (SIGSTOP) with a tiny receive window while 40 batches of ~0.8 MB each (a chain
    of 256 blocks of 1024 tokens, then their delete) are published, with a 1-batch queue at the daemon: more than
    the kernel's buffers hold, so its queue fills. Every put and delete completes while it is stopped; the stall
    is counted; once it runs again it has a gap in its sequence numbers, and a replay gives it every batch."""
    import json
    import os
    import signal
    import sys

    opts = daemon_options(tmp_path, disk=False, kv_events_hwm=1)
    d = make_daemon(**opts)
    rep = str(opts["kv_events_replay_endpoint"])
    child = subprocess.Popen([sys.executable, "-c", _STUCK, str(opts["kv_events_endpoint"]), MODEL],
                             stdout=subprocess.PIPE, text=True)
    keys = [b"b%03d" % i for i in range(256)]
    ctx = zmq.Context()
    try:
        with d.client() as c:
            c.register_namespace("kvev/warm", model="warm")
            c.register_namespace("kvev/final", model="final")
            c.register_namespace(NS, model=MODEL)
            for i in range(100):  # until the child's subscription is in place and it has said so
                c.put("kvev/warm", b"s%d" % i, b"s")
                if select_line(child, 0.2) == "ready":
                    break
            else:
                raise AssertionError("the subscriber never got a sentinel")
            os.kill(child.pid, signal.SIGSTOP)
            wait_until(lambda: _state(child.pid) == "T", what="the subscriber stopped")
            for r in range(40):
                chain = [BlockOrigin.of([vllm_hash(r * 256 + i) * 2], vllm_hash(r * 256 + i - 1) * 2 if i else None,
                                        [i % 60000] * 1024, 1024) for i in range(256)]
                c.annotate(NS, keys, chain)
                assert c.put_many(NS, keys, [b"v" * 1024] * 256).stored == 256
                assert c.delete(NS, keys) == 256
            assert c.health().status == "SERVING"
            c.put(NS, b"last", b"v")  # the topic's last batch
            last = BlockStored((b"last",), None, (), 0, "CPU", None, "kvstore-key")
            wait_until(lambda: events_of(replay(ctx, rep, [topic(d), (0).to_bytes(8, "big")])[-2][2])[-1] == last,
                       what="every batch published")  # the replay buffer holds every batch of the topic
            assert kv_metrics(d)["kvstore_kv_events_subscriber_stalls_total"] >= 1
            os.kill(child.pid, signal.SIGCONT)
            for i in range(100):  # it drains what its queues held, then a final marker ends it
                c.put("kvev/final", b"f%d" % i, b"f")
                line = select_line(child, 0.5)
                if line:
                    break
        got = json.loads(line)
        everything = [int.from_bytes(s, "big") for _, s, _ in replay(ctx, rep, [topic(d), (0).to_bytes(8, "big")])[:-1]]
        assert everything == list(range(len(everything)))  # the replay gives back every batch, in order
        assert got == sorted(set(got)) and set(got) < set(everything)  # it lost some, and sees the gap
    finally:
        ctx.term()
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def select_line(p: subprocess.Popen, timeout_s: float) -> str:
    import select

    assert p.stdout is not None
    r, _, _ = select.select([p.stdout], [], [], timeout_s)
    return p.stdout.readline().strip() if r else ""


def test_annotate_is_checked_and_kept_only_where_events_are_published(make_daemon, tmp_path) -> None:
    on = make_daemon(**daemon_options(tmp_path, disk=False))
    off = make_daemon()
    for d, publishing in ((on, True), (off, False)):
        with d.client() as c:
            assert c.kv_events is publishing
            c.register_namespace(NS)
            assert c.annotate(NS, [b"a", b"b"], origins(0, 2)) == (2 if publishing else 0)
            with pytest.raises(UnknownNamespaceError):
                c.annotate("kvev/unknown", [b"a"], origins(0, 1))
            bad = [BlockOrigin.of([b"x" * 65], None, [], BLOCK),          # a hash over 64 bytes
                   BlockOrigin.of([b"h"], None, [1, 2, 3], BLOCK),          # 3 tokens for a block of 4
                   BlockOrigin.of([b"h"], None, [], 0)]                     # block size 0
            for o in bad:  # refused by the client first, and by the daemon (bypassing the client's check)
                with pytest.raises(InvalidRequestError):
                    c.annotate(NS, [b"a"], [o])
                with pytest.raises(InvalidRequestError):
                    _raw_annotate(c, NS, [b"a"], o)
            assert c.health().status == "SERVING"


def _raw_annotate(c: Client, ns: str, keys: list[bytes], o: BlockOrigin) -> None:
    from kvstore._proto import kvstore_pb2 as pb
    c._rpc.call("Annotate", pb.AnnotateRequest(
        namespace=ns, keys=keys, block_size=o.block_size,
        origins=[pb.BlockOrigin(block_hashes=list(o.block_hashes), token_ids=o.token_ids.tolist())]))


# -- the publisher without a daemon -------------------------------------------------------------------------
def test_events_lost_before_publishing_give_all_blocks_cleared_then_the_stores_truth(ctx) -> None:
    """16 store events fit the publisher's queue; 30 are published before its thread starts: the bus drops 14 (a
    gap), and the publisher clears the topic, then stores what the engine holds now (its snapshot) instead."""
    bus = EventBus()
    cfg = KvEventsConfig(node_id="n1", endpoint=f"tcp://127.0.0.1:{free_port()}", queue_events=16)
    holds = {"ns": ([b"k28", b"k29"], [b"k29"])}  # what the engine holds after the 30 puts: RAM, disk
    calls = []

    def snapshot():  # the first call is start()'s (what a fresh store holds: nothing), the next the gap's
        calls.append(1)
        return ((n, r, k) for n, (r, k) in holds.items()) if len(calls) > 1 else iter(())
    pub = KvEventsPublisher(cfg, bus, lambda ns: ("m", ""), snapshot)
    sub = Subscriber(ctx, cfg.endpoint, decode=events_of)
    try:
        # the subscription must be at the XPUB before the thread publishes (a PUB drops what nobody subscribed
        # to yet): read it off the socket here, before start(), while no other thread uses it
        assert pub._pub.poll(10000) and pub._pub.recv() == b"\x01"
        pub.annotate("ns", [b"k29"], origins(29, 1))
        for i in range(30):
            bus.publish(STORED, "ns", [b"k%d" % i], Tier.RAM)
        pub.start()
        evs = [norm(e) for e in sub.wait_events(b"kv@n1@m", 20)]
        flag = ("kvstore-key",)
        assert evs[:16] == [("stored", "CPU", (b"k%d" % i,), None, (), 0, None, *flag) for i in range(16)]
        assert evs[16:] == [
            ("cleared",),
            ("stored", "CPU", (b"k28",), None, (), 0, None, *flag),
            ("stored", "CPU", (vllm_hash(29),), vllm_hash(28), (1029,) * BLOCK, BLOCK, None, "kvstore"),
            ("stored", "STORAGE", (vllm_hash(29),), vllm_hash(28), (1029,) * BLOCK, BLOCK, None, "kvstore")]
        assert pub.status()["queue_dropped_events"] == 14 and len(calls) == 2
    finally:
        sub.close()
        pub.stop()


# -- configuration ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-events-endpoint", "tcp://*:5557"], r"kv_events_endpoint='tcp://\*:5557'"),
    (["--kv-events-endpoint", "udp://1.2.3.4:1"], "use tcp://HOST:PORT"),
    (["--kv-events-endpoint", "ipc://relative"], "absolute path"),
    (["--kv-events-replay-endpoint", "tcp://127.0.0.1:5557"], "must differ"),
    (["--kv-events-topic", "kv@{pod}"], r"unknown field\(s\) \['pod'\]"),
    (["--kv-events-topic", "kv@{node"], "kv_events_topic"),
    (["--kv-events-buffer-batches", "0"], "kv_events_buffer_batches=0"),
    (["--kv-events-hwm", "0"], "kv_events_hwm=0"),
    (["--kv-events-queue", "3"], "kv_events_queue=3"),
    (["--kv-events", "--kv-events-endpoint", "tcp://10.1.2.3:5557"], "allow_insecure_remote"),
    (["--kv-events", "--kv-events-replay-endpoint", "tcp://0.0.0.0:5558"], "allow_insecure_remote"),
])
def test_bad_settings_stop_the_daemon_with_a_message(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([*BASE, *flags], env={})


def test_tokens_file_and_kv_events_are_refused_together(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("alice " + "a" * 32 + "\n")
    tokens.chmod(0o600)
    with pytest.raises(ConfigError, match="kv_events with tokens_file"):
        load_config([*BASE, "--kv-events", "--tokens-file", str(tokens)], env={})
    cfg = load_config([*BASE, "--kv-events", "--kv-events-endpoint", "tcp://10.1.2.3:5557",
                       "--allow-insecure-remote"], env={})
    assert cfg.kv_events_config().topic_for("ns", "llama", "t") == f"kv@{cfg.node_id}@llama"


def test_a_taken_endpoint_stops_the_daemon_and_says_which(tmp_path) -> None:
    port = free_port()
    blocker = zmq.Context().socket(zmq.PUB)
    blocker.bind(f"tcp://127.0.0.1:{port}")
    try:
        d = DaemonProcess(kv_events=True, kv_events_endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(RuntimeError, match=f"cannot bind kv_events_endpoint='tcp://127.0.0.1:{port}'"):
            d.start()
        d.close()
    finally:
        blocker.close(linger=0)
