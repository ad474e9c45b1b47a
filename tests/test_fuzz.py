"""Property-based fuzzing against a live daemon: random and malformed requests on every RPC of the proto,
random / truncated / oversized / lying frames on the peer data port and on the same-node fast path. Afterwards: the process is alive, Health
answers, no request got INTERNAL, and no slot leaked (reservations and leases expire or are released, then a
clear of every namespace brings the arena back to zero allocated bytes).

Bounded for the suite (~30-60 s on 2 cores); KVSTORE_FUZZ_EXAMPLES raises the example count of each property.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore._proto import kvstore_pb2 as pb
from kvstore.testing import DaemonProcess, EtcdProcess, etcd_binary, peer_options, raw_stub, wait_until
from kvstore.testing.fuzz import METHODS, FuzzStats, Pools, RandomSource, fuzz_frame, fuzz_raw, fuzz_rpc
from kvstore.testing.fuzz_fast import FastFuzzer
from tests.required import missing

EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "800"))
FRAME_EXAMPLES = max(50, EXAMPLES // 4)
NAMESPACES = ["fz/a", "fz/b", "fz/c"]
STATS = FuzzStats()
_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
                     suppress_health_check=list(HealthCheck))


class HypoSource:
    """kvstore.testing.fuzz.Source over hypothesis' st.data(), so failures shrink."""

    def __init__(self, data: st.DataObject) -> None:
        self.d = data

    def int(self, lo: int, hi: int) -> int:
        return self.d.draw(st.integers(lo, hi))

    def choice(self, seq):
        return seq[self.d.draw(st.integers(0, len(seq) - 1))]

    def bytes(self, max_len: int) -> bytes:
        return self.d.draw(st.binary(max_size=max_len))

    def text(self, max_len: int) -> str:
        return self.d.draw(st.text(max_size=max_len))


@pytest.fixture(scope="module")
def target():
    with ExitStack() as stack:
        opts: dict[str, object] = dict(arena_bytes="32MiB", max_block_bytes="1MiB", lease_ttl_s=1.0,
                                       reservation_ttl_s=1.0, quarantine_s=0.2, sweep_interval_s=0.05,
                                       disk_bytes="16MiB", disk_segment_bytes="4MiB", max_subscribers=2)
        etcd = stack.enter_context(EtcdProcess()) if etcd_binary() else None
        if etcd is not None:
            opts.update(peer_options(etcd, timeout_s=0.5))
        d = stack.enter_context(DaemonProcess(**opts))
        ch, stub = raw_stub(d.address)
        stack.callback(ch.close)
        for ns in NAMESPACES:
            stub.RegisterNamespace(pb.RegisterNamespaceRequest(name=ns))
        with d.client() as c:
            for ns in NAMESPACES:
                c.put_many(ns, [b"k%d" % i for i in range(8)], [bytes([i]) * (1000 + i) for i in range(8)])
        pools = Pools(list(NAMESPACES), max_block_bytes=1 << 20)
        yield d, ch, stub, pools


@_SETTINGS
@given(data=st.data())
def _rpc_property(target, data) -> None:
    d, ch, _, pools = target
    src = HypoSource(data)
    method = src.choice(METHODS)
    if src.int(0, 9) == 0:
        fuzz_raw(ch, method, src, STATS)
    else:
        fuzz_rpc(ch, method, src, pools, STATS)


def test_fuzz_every_rpc(target) -> None:
    d, ch, _, pools = target
    src = RandomSource(8)
    for method in METHODS:  # a sweep first, so every RPC is fuzzed whatever hypothesis favours
        for _ in range(10):
            fuzz_rpc(ch, method, src, pools, STATS)
        fuzz_raw(ch, method, src, STATS)
    _rpc_property(target)
    d = target[0]
    assert d.proc.poll() is None, d.log()[-3000:]
    assert set(STATS.calls) == {m.name for m in METHODS}, "every RPC of the proto was fuzzed"
    assert not STATS.internal, STATS.internal[:5]
    print(f"\nfuzzed {STATS.rpcs} RPCs ({STATS.raw_calls} raw): {dict(STATS.calls)}; codes {dict(STATS.codes)}")


@settings(max_examples=FRAME_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def _frame_property(target, data) -> None:
    d, _, stub, pools = target
    host, _, port = stub.Health(pb.HealthRequest(), timeout=5).peers.data_address.rpartition(":")
    fuzz_frame((host, int(port)), HypoSource(data), pools, STATS)


def test_fuzz_peer_frames(target) -> None:
    d, _, stub, _ = target
    if not stub.Health(pb.HealthRequest(), timeout=5).peers.enabled:
        missing("etcd (the etcd server binary): no peer data port to fuzz",
                "apt-get install -y etcd-server (make setup does)")
    _frame_property(target)
    assert d.proc.poll() is None, d.log()[-3000:]
    counters = stub.Stats(pb.StatsRequest(), timeout=5).peers.counters
    assert counters["frame_errors"] > 0
    print(f"\nfuzzed {STATS.frames} frames; frame_errors={counters['frame_errors']}")


FAST: list[FastFuzzer] = []


@settings(max_examples=FRAME_EXAMPLES * 2, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def _fast_property(target, data) -> None:
    FAST[0].step(HypoSource(data), target[3], STATS)


def test_fuzz_fast_path_frames(target) -> None:
    """Frames on the same-node socket: well-formed and not, on one connection re-dialled when the daemon closes it
    (it may close only after an error flagged CLOSING, or when the client itself vanished mid-frame)."""
    d, _, stub, pools = target
    FAST.append(FastFuzzer(d.socket_path + ".arena"))
    src = RandomSource(9)
    for _ in range(300):  # a sweep first, so every op and mutation is hit whatever hypothesis favours
        FAST[0].step(src, pools, STATS)
    _fast_property(target)
    FAST[0].close()
    assert d.proc.poll() is None, d.log()[-3000:]
    assert FAST[0].unexpected_closes == []
    assert not STATS.internal, STATS.internal[:5]
    ops = {k for k in STATS.calls if k.startswith("fast:")}
    assert {"fast:Lookup", "fast:Reserve", "fast:Commit", "fast:Abort", "fast:Release", "fast:Exists",
            "fast:Echo", "fast:Hello", "fast:Probe", "fast:Spare", "fast:Store", "fast:unknown"} <= ops
    assert STATS.codes["fast:ok"] > 0 and STATS.codes["fast:invalid_request"] > 0
    assert STATS.codes["fast:one_way_ok"] > 0 and STATS.codes["fast:one_way_answered"] == 0  # HITS: never a reply
    control = stub.Stats(pb.StatsRequest(), timeout=5).control
    assert control.fast_frame_errors > 0
    print(f"\nfuzzed {sum(v for k, v in STATS.calls.items() if k.startswith('fast:'))} fast-path frames; "
          f"{ {k: v for k, v in STATS.codes.items() if k.startswith('fast:')} }")


def test_after_fuzzing_alive_healthy_and_no_slot_leaked(target) -> None:
    d, _, stub, _ = target
    assert d.proc.poll() is None
    assert stub.Health(pb.HealthRequest(), timeout=5).status in ("SERVING", "DEGRADED")

    def quiet() -> bool:
        s = stub.Stats(pb.StatsRequest(), timeout=5)
        return s.reserved_bytes == 0 and s.leased_bytes == 0 and s.leases_active == 0 and s.reservations_active == 0
    wait_until(quiet, 15, 0.1, "reservations and leases to expire")
    for n in stub.Stats(pb.StatsRequest(), timeout=5).namespaces:
        stub.ClearNamespace(pb.ClearNamespaceRequest(namespace=n.name), timeout=10)
    wait_until(lambda: stub.Stats(pb.StatsRequest(), timeout=5).allocated_bytes == 0, 15, 0.1,
               "every arena slot to come back after clearing every namespace")
    s = stub.Stats(pb.StatsRequest(), timeout=5)
    assert (s.blocks, s.stored_bytes, s.pinned_bytes) == (0, 0, 0)
    with pytest.raises(grpc.RpcError):  # and it still rejects nonsense cleanly
        stub.Lookup(pb.LookupRequest(namespace="fz/a", keys=[b""]), timeout=5)
