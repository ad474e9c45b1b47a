"""Round trips through a real daemon: arena path, stream path, and the two mixed."""

from __future__ import annotations

import pytest

import hashlib
import os
import random

import numpy as np

from kvstore import Client
from tests.control_paths import per_path_daemon
from kvstore.testing import DaemonProcess

pytestmark = pytest.mark.usefixtures("control_path")  # every test over the fast path and over gRPC
daemon = per_path_daemon()


# KV blocks come in a few sizes per deployment; the odd ones check that payload != slot size works.
SIZES = (1, 4095, 64 << 10, 256 << 10, 300_000, 2 << 20, 3 << 20)


def _blocks(n: int, seed: int, max_size: int = 1 << 20) -> tuple[list[bytes], list[bytes]]:
    rng = random.Random(seed)
    keys = [hashlib.sha256(b"%d-%d" % (seed, i)).digest() for i in range(n)]
    sizes = [s for s in SIZES if s <= max_size]
    values = [rng.randbytes(rng.choice(sizes)) for _ in range(n)]
    return keys, values


def test_arena_round_trip_many_blocks(daemon: DaemonProcess) -> None:
    with daemon.client() as c:
        assert c.mode == "arena"
        ns = "rt/arena"
        assert c.register_namespace(ns, model="m", layout_digest="d", tenant="t") is True
        assert c.register_namespace(ns, model="m", layout_digest="d", tenant="t") is False
        keys, values = _blocks(120, seed=1, max_size=256 << 10)
        r = c.put_many(ns, keys, values)
        assert (r.stored, r.already_present, r.in_flight) == (120, 0, 0)
        assert c.put_many(ns, keys[:10], values[:10]).already_present == 10
        assert c.get_many(ns, keys) == values
        bufs = [np.zeros(len(v) + 7, dtype=np.uint8) for v in values]
        sizes = c.get_many_into(ns, keys, bufs)
        assert sizes == [len(v) for v in values]
        assert all(b[: len(v)].tobytes() == v for b, v in zip(bufs, values))
        assert c.get(ns, b"absent") is None
        assert c.exists(ns, [keys[0], b"absent", keys[5]]) == [True, False, True]
        s = c.stats()
        nsinfo = next(n for n in s.namespaces if n.name == ns)
        assert (nsinfo.blocks, nsinfo.bytes, nsinfo.puts) == (120, sum(map(len, values)), 120)
        listed = list(c.keys(ns, page_size=7))
        assert [k.key for k in listed] == sorted(keys)
        assert {k.key: k.size for k in listed} == {k: len(v) for k, v in zip(keys, values)}
        assert c.delete(ns, keys[:30]) == 30
        assert c.delete(ns, keys[:30]) == 0
        assert sum(c.exists(ns, keys)) == 90
        assert c.clear(ns) == 90
        assert next(n for n in c.stats().namespaces if n.name == ns).blocks == 0


def test_stream_and_arena_paths_agree(daemon: DaemonProcess) -> None:
    ns = "rt/mixed"
    keys, values = _blocks(12, seed=2, max_size=3 << 20)
    with Client(daemon.tcp_address, mode="stream") as remote, daemon.client() as local:
        assert remote.mode == "stream" and local.mode == "arena"
        remote.register_namespace(ns)
        assert remote.put_many(ns, keys[:6], values[:6]).stored == 6
        assert local.put_many(ns, keys[6:], values[6:]).stored == 6
        assert local.get_many(ns, keys) == values
        assert remote.get_many(ns, keys) == values
        buf = bytearray(3 << 20)
        assert remote.get_into(ns, keys[7], buf) == len(values[7])
        assert bytes(buf[: len(values[7])]) == values[7]
        assert remote.get(ns, b"missing") is None
        assert remote.lookup_prefix(ns, keys[:3] + [b"missing"] + keys[3:]) == 3


def test_batches_larger_than_the_daemon_limit_are_split(make_daemon) -> None:
    d = make_daemon(max_batch_keys=16)
    ns = "rt/split"
    with d.client() as c:
        c.register_namespace(ns)
        keys = [b"k%03d" % i for i in range(50)]
        values = [os.urandom(100) for _ in keys]
        assert c.put_many(ns, keys, values).stored == 50
        assert c.get_many(ns, keys) == values
        assert c.lookup_prefix(ns, keys) == 50
        assert c.exists(ns, keys) == [True] * 50
        assert c.delete(ns, keys) == 50
