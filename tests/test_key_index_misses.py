"""A probe that stops short, answered by the client from an authoritative key index (a daemon with RAM only).

Tries to break it: the answer and every counter (the miss and its cause included) must equal what the daemon
says when asked; a daemon with a disk tier, a table that once skipped a key, a Store answered before its keys
were indexed (in process, where the deferral can be held open), the index changing during the probe, and a
namespace the daemon never answered this client in (unknown, or another tenant's) all make the client ask.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.engine.misses import COUNTER_OF
from kvstore.errors import InvalidRequestError, KVStoreError, UnknownNamespaceError
from kvstore.fastpath.key_index import IndexView, MissState
from kvstore.testing import DaemonProcess
from tests.engine_helpers import NS, KiB, MiB, make_rig
from tests.fast_helpers import keyset, moved, no_index_client, two_chains
from tests.tenant_helpers import A_NS, B_NS, tenant_clients

BLOCK = 64 * KiB  # spare slots: a connection may hold a share of the arena
COUNTED = ("lookup_calls", "lookup_keys", "hit_keys", "hit_keys_ram", *COUNTER_OF.values())


def view_of(c: Client) -> IndexView:
    index = c._control.index  # type: ignore[union-attr]
    assert index is not None
    v = index.view()
    assert v is not None
    return v


@pytest.fixture(scope="module")
def ram_only():
    with DaemonProcess(arena_bytes="64MiB") as d:
        yield d


def test_short_probes_are_answered_here_and_count_as_the_daemons(ram_only: DaemonProcess,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keyset("short", 300)
    two_chains(ram_only, ("mx/a", "mx/b"), keys)
    with ram_only.client() as w:
        assert w.delete("mx/a", keys[200:201]) == 1  # a miss whose cause is not "never stored"
    with Client(ram_only.address, control="fast") as fast, no_index_client(ram_only.address, monkeypatch) as plain:
        assert view_of(fast).miss_state() == MissState(1, 0, 0)
        # (chain, answered here?): the first key absent needs a namespace the daemon answered this client in,
        # which the first such probe's PROBE reply is
        steps = [("held, then new", keys, True), ("deleted inside", keys[150:250], True),
                 ("new first", keys[290:] + keys[:10], False), ("new first, again", keys[295:], True),
                 ("one new key", keys[299:], True)]
        for name, chain, here in steps:
            a, da = moved(fast, lambda: fast.probe_prefix_tiers(["mx/a"], chain), COUNTED)
            b, db = moved(plain, lambda: plain.probe_prefix_tiers(["mx/a"], chain), COUNTED)
            assert a == b, name
            assert {**da, "fast_requests": 0} == {**db, "fast_requests": 0}, name
            assert da["lookup_calls"] == 1 and sum(v for k, v in da.items() if k.startswith("misses_")) == 1, name
            # here: the one-way HITS and Stats' settling Echo; else the PROBE
            assert (da["fast_requests"], db["fast_requests"]) == ((2 if here else 1), 1), name
        got = {name: fast.probe_prefix_tiers(["mx/a"], chain)[0] for name, chain, _ in steps}
        assert got == {"held, then new": 200, "deleted inside": 50, "new first": 0, "new first, again": 0,
                       "one new key": 0}
        _, da = moved(fast, lambda: fast.probe_prefix_tiers(["mx/a"], keys), COUNTED)
        assert (da["misses_deleted"], da["misses_never_stored"]) == (1, 0)
        # a model's two shards: one round trip's worth of answers, none of it sent for (two HITS, one Echo)
        a, da = moved(fast, lambda: fast.probe_prefix_many(["mx/a", "mx/b"], keys), COUNTED)
        b, db = moved(plain, lambda: plain.probe_prefix_many(["mx/a", "mx/b"], keys), COUNTED)
        assert a == b == (100, True) and {**da, "fast_requests": 0} == {**db, "fast_requests": 0}
        # mx/a stops at its deleted key, mx/b at a key mx/a holds
        assert (da["fast_requests"], da["lookup_keys"], da["misses_deleted"], da["misses_other_namespace"]) == \
            (3, 600, 1, 1)


def test_a_namespace_never_answered_in_is_asked_about(tmp_path: Path, ram_only: DaemonProcess) -> None:
    keys = keyset("nowhere", 4)
    with Client(ram_only.address, control="fast") as c:
        with pytest.raises(UnknownNamespaceError):
            c.probe_prefix_tiers(["mx/never-registered"], keys)
    with tenant_clients(tmp_path, control="fast") as (_, alice, bob):
        alice.put_many(A_NS, keys[:2], [b"a" * 100] * 2)
        assert view_of(bob).miss_state().settled  # RAM only: authoritative, yet bob's table lacks A_NS
        with pytest.raises(KVStoreError):
            bob.probe_prefix_tiers([A_NS], keys)  # alice's namespace: the daemon refuses, not a local miss
        assert bob.probe_prefix_tiers([B_NS], keys) == (0, [])
        assert alice.probe_prefix_tiers([A_NS], keys) == (2, [1, 1])


def test_a_key_the_daemon_would_refuse_gets_its_refusal(ram_only: DaemonProcess) -> None:
    keys = keyset("refused", 3)
    with Client(ram_only.address, control="fast") as c:
        c.register_namespace("mx/refused")
        c.put_many("mx/refused", keys[:2], [b"r" * 100] * 2)
        assert c.probe_prefix_tiers(["mx/refused"], keys) == (2, [1, 1])  # answered here: authoritative
        for bad in (b"", b"k" * 65):  # keys are 1..64 bytes (kvstore.validation): the daemon says so, not a miss
            with pytest.raises(InvalidRequestError, match="keys must be 1..64 bytes"):
                c.probe_prefix_tiers(["mx/refused"], keys[:2] + [bad])


def test_a_daemon_with_a_disk_tier_has_no_authority(tmp_path: Path) -> None:
    with DaemonProcess(arena_bytes="32MiB", disk_bytes="32MiB", disk_segment_bytes="4MiB") as d, \
            Client(d.address, control="fast") as c:
        c.register_namespace("disk/a")
        c.put_many("disk/a", keyset("d", 3), [b"x" * 100] * 3)
        state = view_of(c).miss_state()
        assert state.authority == 0 and not state.settled  # a key absent from RAM may be on disk
        _, delta = moved(c, lambda: c.probe_prefix_tiers(["disk/a"], keyset("d", 5)), COUNTED)
        assert (delta["fast_requests"], delta["hit_keys"], delta["misses_never_stored"]) == (1, 3, 1)


def test_the_index_changing_during_the_probe_makes_the_client_ask(ram_only: DaemonProcess,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keyset("moving", 8)
    with Client(ram_only.address, control="fast") as c:
        c.register_namespace("mx/moving")
        c.put_many("mx/moving", keys[:4], [b"m" * 100] * 4)
        view = view_of(c)
        # a Store deferred its binding between the read before the probe and the read after it
        states = iter([MissState(1, 5, 5), MissState(1, 6, 5)])
        monkeypatch.setattr(view, "miss_state", lambda: next(states))
        got, delta = moved(c, lambda: c.probe_prefix_tiers(["mx/moving"], keys), COUNTED)
        assert got == (4, [1, 1, 1, 1]) and delta["fast_requests"] == 1  # the PROBE
        # a binding still pending before the probe
        monkeypatch.setattr(view, "miss_state", lambda: MissState(1, 6, 5))
        _, delta = moved(c, lambda: c.probe_prefix_tiers(["mx/moving"], keys), COUNTED)
        assert delta["fast_requests"] == 1


def test_a_store_bound_after_its_reply_holds_the_authority_until_bound() -> None:
    rig = make_rig(data_bytes=4 * MiB, max_block=BLOCK)
    eng = rig.engine
    mirror = eng.attach_key_index(64, incarnation=7, per_tenant=False, authoritative=True)
    view = IndexView(mirror.reader_fd(""))
    keys = keyset("late", 3)
    assert view.miss_state() == MissState(1, 0, 0) and view.miss_state().settled
    _, offsets = eng.spare(owner=1, size=BLOCK, count=3)
    assert eng.store(1, NS, keys, [BLOCK] * 3, offsets, settle_later=True).stored == 3
    # answered, not yet indexed: an absent key is no answer now
    assert view.miss_state() == MissState(1, 1, 0) and not view.miss_state().settled
    assert view.probe(NS, keys) == (0, b"", b"")
    eng.settle()
    assert view.miss_state() == MissState(1, 1, 1) and view.miss_state().settled
    assert view.probe(NS, keys)[0] == 3
    # a Store bound before its reply defers nothing
    _, offsets = eng.spare(owner=1, size=BLOCK, count=1)
    eng.store(1, NS, keyset("now", 1), [BLOCK], offsets)
    assert view.miss_state() == MissState(1, 1, 1)


def test_a_table_that_skips_a_key_loses_its_authority_for_good() -> None:
    rig = make_rig(data_bytes=4 * MiB, max_block=BLOCK)
    eng = rig.engine
    mirror = eng.attach_key_index(2, incarnation=7, per_tenant=False, authoritative=True)  # 4 slots: 3 keys fit
    view = IndexView(mirror.reader_fd(""))
    keys = keyset("full", 4)
    for k in keys[:3]:
        _, offsets = eng.spare(owner=1, size=BLOCK, count=1)
        eng.store(1, NS, [k], [BLOCK], offsets)
    assert view.miss_state().settled and view.count == 3
    _, offsets = eng.spare(owner=1, size=BLOCK, count=1)
    eng.store(1, NS, keys[3:], [BLOCK], offsets)
    assert (mirror.unindexed, view.count, view.miss_state().authority) == (1, 3, 0)
    assert eng.delete(NS, keys[:3]) == 3  # room again, but a skipped key may still be in RAM: no authority
    assert (view.count, view.miss_state().authority) == (0, 0)
