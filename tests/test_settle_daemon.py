"""A fast-path put answers before the watermark eviction it sets off, and the daemon evicts right after on its
own (kvstore/engine/engine_lock.py, FastServer._answer): a real daemon, a real client, the real shared key index.

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
        got = view.probe(ns, [k])
        assert got is not None, "the key index changed under the read (a daemon restart?)"
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
            if not expect_eviction:
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
