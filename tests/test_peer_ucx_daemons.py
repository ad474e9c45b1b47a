"""The UCX data plane in real daemons joined through a real etcd: fetches land byte-exact, and a daemon that
has served a frame stays idle afterwards.

Why the second: ucxx without Python futures awaits a posted request by yielding to the event loop until it
completes, and a serving daemon always has the next header's receive posted on each open endpoint, so its
loop thread ran at a full core from its first served frame on (1.0 core measured on an idle daemon). The bound
below is far from both: an idle daemon spends ~0.02 of a core.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack

from tests.peer_helpers import Cluster, blocks, needs_etcd, needs_ucx, register

pytestmark = [needs_etcd, needs_ucx]

NS = "ucx@daemons/t"
BLOCK = 256 << 10


def _cpu_s(pid: int) -> float:
    """User + system seconds the process has run (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_share(pid: int, seconds: float) -> float:
    before, t0 = _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (_cpu_s(pid) - before) / (time.monotonic() - t0)


def test_ucx_fetches_land_exactly_and_a_daemon_that_served_them_stays_idle() -> None:
    with ExitStack() as stack:
        cl = Cluster(stack, plane="ucx", ttl_s=5.0, timeout_s=10.0, names=("a", "b"), replication="off")
        register(cl.clients, NS)
        keys = [f"k{i}".encode() for i in range(64)]
        owned = [k for k in keys if cl.owner(NS, k) == "a"][:8]
        assert len(owned) == 8
        values = blocks(8, BLOCK, seed=5)
        cl.clients["a"].put_many(NS, owned, values)
        server = cl.nodes["a"].proc
        assert server is not None
        for round_ in range(2):   # the second round after the idle check: the endpoint still carries frames
            lease = cl.clients["b"].lookup(NS, owned, prefix=True)
            assert lease.num_prefix == 8
            cl.clients["b"].release([lease])
            assert [bytes(v) for v in cl.clients["b"].get_many(NS, owned)] == values
            assert cl.counters("a")["served_blocks"] == 8 * (round_ + 1)
            share = _idle_share(server.pid, 3.0)
            assert share < 0.25, f"the serving daemon used {share:.2f} of a core while idle (round {round_})"
            cl.clients["b"].delete(NS, owned)
