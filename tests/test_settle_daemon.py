"""A fast-path put answers before binding its keys and before the watermark eviction it sets off, and the daemon
does both right after on its own (kvstore/engine/engine_lock.py, writes.py, FastServer._answer); yet any call
made after the put returns sees its keys: a real daemon, real clients, the real shared key index.

How it is seen without asking the daemon (any call that takes the engine's lock would run the eviction itself):
the evicted keys leave the shared key index, which the client reads from its own mapping with no request; the
sweeper (which takes the lock too) runs once a minute here, so only the connection's own settle can evict within
the test's seconds.
"""

from __future__ import annotations

import time

import numpy as np

from kvstore.client import Client
from kvstore.fastpath.key_index import IndexView
from kvstore.testing import DaemonProcess
from tests.fast_helpers import keyset

MiB = 1 << 20
BATCH = 4  # blocks of 1 MiB a put


def _indexed(view: IndexView | None, ns: str, keys: list[bytes]) -> list[bool]:
    assert view is not None, "the client has no key index mapped"
    out = []
    for k in keys:
        for _ in range(1000):  # None: the daemon wrote the index during the read (it binds after its reply)
            got = view.probe(ns, [k])
            if got is not None:
                break
        assert got is not None, "the key index changed under 1000 reads in a row (a daemon restart?)"
        out.append(got[0] == 1)
    return out


def test_a_put_over_the_high_watermark_is_answered_then_evicts_with_no_other_call() -> None:
    ns = "settle/ns"
    keys = keyset("settle", 40 * BATCH)
    values = [np.full(MiB, i % 251, np.uint8) for i in range(len(keys))]
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="1MiB", sweep_interval_s=60) as d, \
            Client(d.address, control="fast") as c, Client(d.address, control="grpc") as watcher:
        c.register_namespace(ns)
        crossed, n = 0, 0
        while not crossed:
            st = watcher.stats()  # before the put: nothing is pending now (Stats takes the engine's lock)
            # the put commits BATCH blocks into spare slots the connection holds and is granted BATCH new ones
            expect_eviction = st.allocated_bytes + BATCH * MiB > st.high_watermark * st.capacity_bytes
            batch = keys[n:n + BATCH]
            c.put_many(ns, batch, values[n:n + BATCH])
            n += BATCH
            view = c._control.index.view()
            if not expect_eviction:  # the keys are bound after the reply too (writes.py): indexed moments later
                deadline = time.monotonic() + 10
                while _indexed(view, ns, batch) != [True] * BATCH and time.monotonic() < deadline:
                    time.sleep(0.001)  # no request to the daemon meanwhile: only its own settle can bind them
                assert _indexed(view, ns, keys[:n]) == [True] * n
                continue
            crossed = n
            deadline = time.monotonic() + 10
            while _indexed(view, ns, keys[:1]) == [True] and time.monotonic() < deadline:
                time.sleep(0.001)  # no request to the daemon meanwhile: only its own settle can evict
            gone = _indexed(view, ns, keys[:n]).count(False)
            assert gone > 0, "the daemon did not evict after answering the put"
        st = watcher.stats()
        evicted = st.counters["evictions"]
        # the oldest `evicted` keys went, in LRU order; every other key is indexed and reads back exactly
        assert _indexed(c._control.index.view(), ns, keys[:n]) == [False] * evicted + [True] * (n - evicted)
        assert st.counters["committed_blocks"] == n and st.blocks == n - evicted
        assert st.allocated_bytes <= st.low_watermark * st.capacity_bytes  # the new spare slots counted in
        buf = np.empty(MiB, np.uint8)
        for i in range(evicted, n):
            assert c.get_into(ns, keys[i], buf) == MiB and (buf == i % 251).all()


def test_every_call_after_a_put_sees_its_keys_although_they_are_bound_after_the_reply() -> None:
    """The put's reply leaves before its keys are in the catalog; a call from any client that reaches the daemon
    runs that work first (the engine's lock), and one the client answers from the key index answers only hits,
    so a miss goes to the daemon. 200 rounds of put-then-read from another client: each sees the whole put."""
    ns = "settle/read"
    with DaemonProcess(arena_bytes="64MiB", max_block_bytes="1MiB", sweep_interval_s=60) as d, \
            Client(d.address, control="fast") as writer, Client(d.address, control="fast") as reader:
        writer.register_namespace(ns)
        buf = np.empty(64 << 10, np.uint8)
        for r in range(200):
            batch = keyset(f"read{r}", 3)
            values = [np.full(64 << 10, (r + j) % 251, np.uint8) for j in range(3)]
            assert writer.put_many(ns, batch, values).stored == 3
            assert reader.probe_prefix(ns, batch) == (3, True)
            assert reader.exists(ns, batch) == [True, True, True]
            assert reader.get_into(ns, batch[2], buf) == 64 << 10 and (buf == (r + 2) % 251).all()
