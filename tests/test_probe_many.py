"""Client.probe_prefix_many: how much of a chain every shard namespace holds, in one pipelined round trip.

The vLLM scheduler asks it for every (pipeline stage, TP rank) namespace of a model; the answer must be the
shortest shard's prefix, RAM-only only when every shard's prefix is in RAM, identical over the fast path and
gRPC, and a namespace the daemon refuses must raise without leaving the connection out of step.
"""

from __future__ import annotations

import pytest

from kvstore.client.fast_channel import FastChannel
from kvstore.client.probes import common_prefix
from kvstore.client.types import Lease
from kvstore.errors import UnknownNamespaceError
from kvstore.fastpath import protocol as fp
from kvstore.testing import DaemonProcess
from tests.control_paths import per_path_daemon

pytestmark = pytest.mark.usefixtures("control_path")
daemon = per_path_daemon()

KEYS = [b"chain-%03d" % i for i in range(12)]
RANKS = ["tp/rank0", "tp/rank1", "tp/rank2"]
HELD = {"tp/rank0": 12, "tp/rank1": 7, "tp/rank2": 9}   # leading keys each rank stores


def _store(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        for ns in RANKS:
            c.register_namespace(ns)
            c.put_many(ns, KEYS[:HELD[ns]], [ns.encode() * 700] * HELD[ns])


def test_the_answer_is_the_shortest_shards_prefix_in_one_call_per_namespace(daemon: DaemonProcess,
                                                                           control_path: str) -> None:
    _store(daemon)
    with daemon.client() as c:
        assert c.control_path == control_path
        before = c.stats()
        assert c.probe_prefix_many(RANKS, KEYS) == (7, True)
        assert c.probe_prefix_many(RANKS[::-1], KEYS) == (7, True)        # order does not matter
        assert c.probe_prefix_many(["tp/rank0"], KEYS) == c.probe_prefix("tp/rank0", KEYS) == (12, True)
        assert c.probe_prefix_many(RANKS, KEYS[:5]) == (5, True)
        assert c.probe_prefix_many(RANKS, []) == (0, True)
        assert c.probe_prefix_many(RANKS, [b"absent"] + KEYS) == (0, True)
        after = c.stats()
    # 3 + 3 + 1 + 1 + 3 + 0 + 3 prefix Lookups, no lease taken
    assert after.counters["lookup_calls"] - before.counters["lookup_calls"] == 14
    assert after.leases_active == 0
    if control_path == "fast":   # pipelined: one frame per namespace, Stats itself goes over gRPC
        assert after.control.fast_requests - before.control.fast_requests == 14


def test_a_refused_namespace_raises_and_the_connection_stays_in_step(daemon: DaemonProcess) -> None:
    _store(daemon)
    with daemon.client() as c:
        with pytest.raises(UnknownNamespaceError, match="never-registered"):
            c.probe_prefix_many(["tp/rank0", "never-registered", "tp/rank1"], KEYS)
        assert c.probe_prefix_many(RANKS, KEYS) == (7, True)   # the replies after the error were read too


def test_call_many_returns_each_reply_in_its_slot(daemon: DaemonProcess) -> None:
    """The raw pipelined call: an error in the middle is returned in its slot, the replies around it stand."""
    _store(daemon)
    ch = FastChannel(daemon.socket_path + ".arena", "", 5.0)
    try:
        flags = fp.LOOKUP_PREFIX | fp.LOOKUP_SUMMARY
        out = ch.call_many([(fp.LOOKUP, fp.encode_lookup(ns, KEYS), flags)
                            for ns in ("tp/rank1", "never-registered", "tp/rank2")])
        assert [fp.decode_lookup_reply(out[i]).num_prefix for i in (0, 2)] == [7, 9]
        assert isinstance(out[1], UnknownNamespaceError)
        assert fp.decode_lookup_reply(ch.call(fp.LOOKUP, fp.encode_lookup("tp/rank0", KEYS), flags)).num_prefix == 12
    finally:
        ch.close()


class _Shards:
    """A ControlPlane stand-in answering probe_many from fixed tiers per namespace (1 RAM, 2 disk, 0 none)."""

    def __init__(self, tiers: dict[str, list[int]]) -> None:
        self.tiers = tiers
        self.calls: list[tuple[list[str], int]] = []

    def probe_many(self, namespaces: list[str], keys: list[bytes]) -> list[Lease]:
        self.calls.append((list(namespaces), len(keys)))
        start = sum(n for _, n in self.calls[:-1])
        out = []
        for ns in namespaces:
            t = self.tiers[ns][start:start + len(keys)]
            n = next((i for i, x in enumerate(t) if x == 0), len(t))
            out.append(Lease(ns, n, [x != 0 for x in t[:n]] + [False] * (n < len(t)), [], [], [], [], 0, 7,
                             t[:n + 1]))
        return out


def test_ram_only_when_every_shards_common_prefix_is_in_ram_and_chunks_stop_at_a_miss() -> None:
    incs: list[int] = []
    shards = _Shards({"a": [1] * 6 + [2, 2], "b": [1] * 8})
    assert common_prefix(shards, incs.append, 4, ["a", "b"], KEYS[:8]) == (8, False)   # a's keys 6-7 on disk
    assert shards.calls == [(["a", "b"], 4), (["a", "b"], 4)] and incs == [7] * 4
    shards = _Shards({"a": [1] * 6 + [2, 2], "b": [1] * 5 + [0, 1, 1]})
    assert common_prefix(shards, incs.append, 4, ["a", "b"], KEYS[:8]) == (5, True)     # a's disk keys are past 5
    shards = _Shards({"a": [1, 1, 0, 1] + [1] * 4, "b": [1] * 8})
    assert common_prefix(shards, incs.append, 4, ["a", "b"], KEYS[:8]) == (2, True)
    assert shards.calls == [(["a", "b"], 4)]                                            # no second chunk
