"""Client.reserve_many: a hybrid model's KV cache groups (one namespace each) reserved in one pipelined round trip.

Every slot answers for its own request (a refused one is its error, the others stand), the reservations commit
and abort as single ones do, and the answers are the same over the fast path and gRPC.
"""

from __future__ import annotations

import pytest

from kvstore.client.types import Reservation
from kvstore.errors import KVStoreError, UnknownNamespaceError
from kvstore.testing import DaemonProcess
from kvstore.vocab import ReserveOutcome
from tests.control_paths import per_path_daemon

pytestmark = pytest.mark.usefixtures("control_path")
daemon = per_path_daemon()

GROUPS = ["hybrid/full", "hybrid/sliding"]
KEYS = [b"k-%02d" % i for i in range(6)]


def test_every_group_reserved_in_one_round_trip(daemon: DaemonProcess, control_path: str) -> None:
    with daemon.client() as c:
        for ns in GROUPS:
            c.register_namespace(ns)
        c.put(GROUPS[1], KEYS[4], b"x" * 1000)                         # one key of the sliding group is stored
        before = c.stats()
        full, sliding = c.reserve_many([(GROUPS[0], KEYS, [1000] * 6), (GROUPS[1], KEYS[3:], [1000] * 3)])
        assert isinstance(full, Reservation) and isinstance(sliding, Reservation)
        assert (full.namespace, sliding.namespace) == tuple(GROUPS)
        assert full.outcomes == [ReserveOutcome.RESERVED] * 6
        assert sliding.outcomes == [ReserveOutcome.RESERVED, ReserveOutcome.ALREADY_PRESENT, ReserveOutcome.RESERVED]
        after = c.stats()
        assert after.counters["reserve_calls"] - before.counters["reserve_calls"] == 2
        if control_path == "fast":
            assert after.control.fast_requests - before.control.fast_requests == 2
        assert c.commit(full) == 6 and c.abort(sliding) == 2
        assert c.exists(GROUPS[0], KEYS) == [True] * 6
        assert c.exists(GROUPS[1], KEYS) == [False] * 4 + [True, False]


def test_a_refused_slot_is_its_error_and_the_others_stand(daemon: DaemonProcess) -> None:
    ns = "hybrid/refused-slot"
    with daemon.client() as c:
        c.register_namespace(ns)
        got = c.reserve_many([(ns, KEYS[:2], [10, 10]), ("never-registered", KEYS[:1], [10]), (ns, KEYS[2:3], [10])])
        assert isinstance(got[1], UnknownNamespaceError) and "never-registered" in str(got[1])
        first, third = got[0], got[2]
        assert isinstance(first, Reservation) and isinstance(third, Reservation)
        assert c.commit(first) == 2 and c.commit(third) == 1
        assert c.exists(ns, KEYS[:4]) == [True] * 3 + [False]
        assert c.reserve_many([]) == []
        (last,) = c.reserve_many([(ns, KEYS[3:4], [10])])
        assert not isinstance(last, KVStoreError) and c.abort(last) == 1
