"""The member watch against a real etcd: the changes under a prefix arrive in order with their revisions, a
watch from a compacted revision is canceled (the caller reads again), close() from another thread ends a reader
that waits, and Membership follows joins and leaves by watch alone, through an etcd restart."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.peer.counters import PeerCounters
from kvstore.peer.etcd import EtcdClient
from kvstore.peer.etcd_watch import PrefixWatch, WatchCanceled, WatchEvent, WatchIdle
from kvstore.peer.membership import Member, Membership
from kvstore.testing import EtcdProcess, wait_until
from tests.peer_helpers import needs_etcd

pytestmark = [needs_etcd]

P = b"/w/"


@pytest.fixture(scope="module")
def etcd():
    with EtcdProcess() as e:
        yield e


def test_changes_arrive_in_order_with_their_revisions(etcd: EtcdProcess) -> None:
    c = EtcdClient([etcd.endpoint], timeout_s=5.0)
    rev, kvs = c.range_prefix_at(P + b"a/")
    assert kvs == [] and rev >= 1
    w = PrefixWatch.open(c, P + b"a/", rev + 1)
    got: list[WatchEvent] = []

    def read() -> None:
        for batch in w.batches():
            got.extend(batch)

    t = threading.Thread(target=read)
    t.start()
    c.put(P + b"a/x", b"1")
    lease = c.grant(5)
    c.put(P + b"a/y", b"2", lease)
    c.put(P + b"b/other", b"not under the prefix")
    c.revoke(lease)
    wait_until(lambda: len(got) == 3, 5, 0.01, "three events")
    w.close()
    t.join(5)
    assert not t.is_alive()
    assert [(e.kind, e.key, e.value) for e in got] == [("put", P + b"a/x", b"1"), ("put", P + b"a/y", b"2"),
                                                       ("delete", P + b"a/y", b"")]
    assert got[0].revision == rev + 1 and got[1].revision == rev + 2 and got[2].revision == rev + 4


def test_a_watch_from_a_compacted_revision_is_canceled(etcd: EtcdProcess) -> None:
    c = EtcdClient([etcd.endpoint], timeout_s=5.0)
    for i in range(3):
        c.put(P + b"c/k", b"%d" % i)
    rev, _ = c.range_prefix_at(P + b"c/")
    c._post("/v3/kv/compaction", {"revision": str(rev)})  # noqa: SLF001  # etcd's own compaction call
    with pytest.raises(WatchCanceled, match="compact"):
        for _ in PrefixWatch.open(c, P + b"c/", rev - 2).batches():
            pass


def test_a_quiet_watch_ends_as_idle_not_as_an_error(etcd: EtcdProcess) -> None:
    c = EtcdClient([etcd.endpoint], timeout_s=5.0)
    rev, _ = c.range_prefix_at(P + b"q/")
    w = PrefixWatch.open(c, P + b"q/", rev + 1, idle_s=0.3)
    with pytest.raises(WatchIdle):
        for _ in w.batches():
            pass
    w.close()


def test_membership_follows_by_watch_through_an_etcd_restart() -> None:
    with EtcdProcess() as e:
        seen: list[set[str]] = []
        counters = PeerCounters()

        def member(name: str, on_change=lambda m: None) -> Membership:
            return Membership(EtcdClient([e.endpoint], timeout_s=1.0), "/m/", Member(name, "", "", "tcp", 0),
                              ttl_s=3.0, refresh_s=1.0, counters=counters if name == "a" else PeerCounters(),
                              on_change=on_change)

        a = member("a", lambda m: seen.append(set(m)))
        a.start()
        b = member("b")
        b.start()
        try:
            wait_until(lambda: set(a.members()) == {"a", "b"}, 5, 0.01, "a to see b")
            e.stop()
            time.sleep(1.5)
            assert set(a.members()) == {"a", "b"} and not a.connected  # the last member set, still served
            e.start()
            wait_until(lambda: a.connected, 10, 0.05, "a back on etcd")
            c = member("c")
            c.start()
            wait_until(lambda: set(a.members()) == {"a", "b", "c"}, 5, 0.01, "a to see c after the restart")
            assert c.mark_leaving()                       # draining: still a member, marked in its record
            wait_until(lambda: a.members()["c"].leaving, 5, 0.01, "a to see c leaving")
            assert set(a.members()) == {"a", "b", "c"} and not a.members()["b"].leaving
            c.stop()
            wait_until(lambda: set(a.members()) == {"a", "b"}, 5, 0.01, "a to see c leave")
            b.stop()
            wait_until(lambda: set(a.members()) == {"a"}, 5, 0.01, "a to see b leave")
        finally:
            b.stop()
            a.stop()
        assert seen[0] in ({"a", "b"}, {"a"})
        assert seen[-4:] == [{"a", "b", "c"}, {"a", "b", "c"}, {"a", "b"}, {"a"}]  # the second: c's record, leaving
        assert counters.get("etcd_errors") >= 1 and counters.get("watch_restarts") >= 1
