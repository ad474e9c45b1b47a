"""The engine's side of the shared key index: the mirror follows every way a block enters and leaves RAM, and a
probe through the index (Engine.probe) answers and counts exactly as the Lookup it replaces."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.engine.engine import Engine
from kvstore.errors import InvalidRequestError, UnknownNamespaceError
from kvstore.fastpath.key_index import IndexView
from kvstore.vocab import Tier
from tests.engine_helpers import NS, KiB, MiB, make_rig, put

BLOCK = 64 * KiB
COUNTED = ("lookup_calls", "lookup_keys", "hit_keys", "hit_keys_ram", "hit_keys_disk")


def keyset(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def rig(**cfg: float | int) -> tuple[Engine, IndexView]:
    eng = make_rig(data_bytes=4 * MiB, max_block=1 * MiB, **cfg).engine
    mirror = eng.attach_key_index(1024, incarnation=9, per_tenant=False)
    return eng, IndexView(mirror.reader_fd(""))


def in_ram(eng: Engine, keys: list[bytes], ns: str = NS) -> list[bool]:
    r = eng.lookup(ns, keys, prefix=False, lease=False, local_only=True, summary=True)
    return [t == Tier.RAM for t in r.tiers]


def indexed(view: IndexView, keys: list[bytes], ns: str = NS) -> list[bool]:
    out = []
    for k in keys:
        got = view.probe(ns, [k])
        assert got is not None
        out.append(got[0] == 1)
    return out


def counters(eng: Engine) -> dict[str, int]:
    c = eng.counters
    ns = eng.stats().namespaces[0]
    return {**{k: getattr(c, k) for k in COUNTED}, "ns_lookup_keys": ns.lookup_keys, "ns_hit_keys": ns.hit_keys}


def test_the_index_holds_exactly_the_ram_blocks_through_puts_deletes_leases_and_evictions() -> None:
    eng, view = rig()
    keys = keyset("k", 120)
    put(eng, keys[:10], BLOCK)
    assert indexed(view, keys[:12]) == [True] * 10 + [False] * 2 and view.count == 10
    assert eng.delete(NS, keys[:3]) == 3
    assert indexed(view, keys[:10]) == [False] * 3 + [True] * 7
    held = eng.lookup(NS, keys[3:4], lease=True)                 # deleted while leased: DOOMED, invisible at once
    assert eng.delete(NS, keys[3:4]) == 1 and indexed(view, keys[3:4]) == [False]
    eng.release([held.lease_id])
    for i in range(10, 120, 10):                                 # 4 MiB of 64 KiB blocks: evictions from here on
        put(eng, keys[i:i + 10], BLOCK)
    assert eng.counters.evictions > 0
    assert indexed(view, keys) == in_ram(eng, keys)
    assert view.count == sum(in_ram(eng, keys)) == eng.stats().blocks


def test_a_probe_through_the_index_answers_and_counts_as_the_lookup_it_replaces() -> None:
    eng, view = rig()
    keys = keyset("chain", 40)
    put(eng, keys[:30], BLOCK)
    cases = {"all held": keys[:30], "held then missing": keys, "missing first": keys[35:] + keys[:5]}
    for name, chain in cases.items():
        got = view.probe(NS, chain)
        assert got is not None
        n, ids, serials = got
        before = counters(eng)
        p = eng.probe(NS, np.frombuffer(ids, "<u4"), np.frombuffer(serials, "<u4"), chain[n:])
        mid = counters(eng)
        r = eng.lookup(NS, chain, prefix=True, lease=False, summary=True)
        after = counters(eng)
        assert (p.num_prefix, p.present, p.tiers) == (r.num_prefix, r.present, r.tiers), name
        assert {k: mid[k] - before[k] for k in mid} == {k: after[k] - mid[k] for k in mid}, name
        assert p.num_prefix == min(30, len(chain)) if name != "missing first" else p.num_prefix == 0


def test_what_a_client_claims_is_checked_and_stops_the_prefix_where_it_no_longer_holds() -> None:
    eng, view = rig()
    keys = keyset("claim", 8)
    put(eng, keys, BLOCK)
    eng.register_namespace("other/ns")
    put(eng, keyset("other", 2), BLOCK, ns="other/ns")
    got = view.probe(NS, keys)
    assert got is not None and got[0] == 8
    ids, serials = np.frombuffer(got[1], "<u4").copy(), np.frombuffer(got[2], "<u4").copy()

    def answer(i: np.ndarray, s: np.ndarray, tail: list[bytes] = ()) -> tuple[int, list[bool], list[int]]:  # type: ignore[assignment]
        r = eng.probe(NS, i, s, list(tail))
        return r.num_prefix, r.present, r.tiers
    ram, none = int(Tier.RAM), int(Tier.NONE)
    assert answer(ids, serials) == (8, [True] * 8, [ram] * 8)
    bad = serials.copy()
    bad[5] += 1                                          # an id reused since the client read it
    assert answer(ids, bad, keys[8:]) == (5, [True] * 5 + [False], [ram] * 5 + [none])
    other = ids.copy()
    other[2] = np.frombuffer(view.probe("other/ns", keyset("other", 1))[1], "<u4")[0]  # another namespace's entry
    assert answer(other, serials)[0] == 2
    past = ids.copy()
    past[0] = 1 << 31                                    # no such entry
    assert answer(past, serials)[0] == 0
    assert eng.delete(NS, keys[6:7]) == 1                # evicted or deleted between the client's read and now
    assert answer(ids, serials)[0] == 6
    with pytest.raises(InvalidRequestError, match="entry ids"):
        eng.probe(NS, ids, serials[:3], [])
    with pytest.raises(UnknownNamespaceError):
        eng.probe("no/such", ids, serials, [])
    with pytest.raises(InvalidRequestError):
        eng.probe(NS, ids, serials, [b""])               # the tail's keys are checked as a Lookup's


def test_a_namespace_that_changes_tenant_takes_its_indexed_keys_along() -> None:
    eng = make_rig(data_bytes=4 * MiB, max_block=1 * MiB).engine
    mirror = eng.attach_key_index(1024, incarnation=1, per_tenant=True)
    eng.register_namespace("t/ns", tenant="alice")
    keys = keyset("moving", 5)
    put(eng, keys[:4], BLOCK, ns="t/ns")
    assert mirror.counts() == {"alice": 4}
    eng._names.get("t/ns").tenant = "bob"  # what adopting a recovered namespace does (namespaces.py)
    put(eng, keys[4:], BLOCK, ns="t/ns")
    assert mirror.counts() == {"alice": 0, "bob": 5}
    bob = IndexView(mirror.reader_fd("bob"))
    assert bob.probe("t/ns", keys)[0] == 5
    assert IndexView(mirror.reader_fd("alice")).probe("t/ns", keys)[0] == 0


def test_a_full_index_leaves_keys_to_the_daemon_and_says_how_many() -> None:
    eng = make_rig(data_bytes=4 * MiB, max_block=1 * MiB).engine
    mirror = eng.attach_key_index(8, incarnation=1, per_tenant=False)  # 16 slots: 12 keys at most
    view = IndexView(mirror.reader_fd(""))
    keys = keyset("many", 20)
    put(eng, keys, BLOCK)
    assert view.count == 12 and mirror.unindexed == 8
    n, ids, serials = view.probe(NS, keys)
    assert n == 12
    r = eng.probe(NS, np.frombuffer(ids, "<u4"), np.frombuffer(serials, "<u4"), keys[n:])
    assert r.num_prefix == 20  # the daemon found the rest the usual way


def test_entries_of_several_namespaces_told_at_once_are_each_indexed_under_their_own() -> None:
    eng = make_rig(data_bytes=4 * MiB, max_block=1 * MiB).engine
    mirror = eng.attach_key_index(64, incarnation=1, per_tenant=False)
    eng.register_namespace("other/ns")
    a, b = keyset("a", 2), keyset("b", 2)
    put(eng, a, BLOCK)
    put(eng, b, BLOCK, ns="other/ns")
    view = IndexView(mirror.reader_fd(""))
    ids = {ns: np.frombuffer(view.probe(ns, ks)[1], "<u4").tolist() for ns, ks in ((NS, a), ("other/ns", b))}
    mirror.table("").remove(NS, a)  # take them out behind the mirror's back, then tell it all in one call
    mirror.table("").remove("other/ns", b)
    assert view.count == 0
    mirror.added([ids[NS][0], ids["other/ns"][0], ids[NS][1], ids["other/ns"][1]])
    assert view.probe(NS, a)[0] == 2 and view.probe("other/ns", b)[0] == 2 and view.count == 4
    assert view.probe(NS, b)[0] == 0


def test_a_lookup_by_entry_ids_is_the_lookup_of_their_keys_or_nothing_at_all() -> None:
    eng, view = rig()
    keys = keyset("byid", 6)
    put(eng, keys, BLOCK)
    got = view.probe(NS, keys)
    assert got is not None and got[0] == 6
    ids, serials = np.frombuffer(got[1], "<u4"), np.frombuffer(got[2], "<u4")
    for prefix in (False, True):
        for lease in (False, True):
            before = counters(eng)
            a = eng.lookup_entries(NS, ids, serials, prefix=prefix, lease=lease)
            mid = counters(eng)
            b = eng.lookup(NS, keys, prefix=prefix, lease=lease)
            after = counters(eng)
            assert a is not None
            assert (a.num_prefix, a.present, a.offsets, a.sizes, a.generations, a.checksums, a.tiers) == (
                b.num_prefix, b.present, b.offsets, b.sizes, b.generations, b.checksums, b.tiers), (prefix, lease)
            assert {k: mid[k] - before[k] for k in mid} == {k: after[k] - mid[k] for k in mid}, (prefix, lease)
            assert (a.lease_id > 0, b.lease_id > 0) == (lease, lease) and (not lease or a.lease_id != b.lease_id)
            if lease:
                assert eng.release([a.lease_id, b.lease_id]) == 2
    assert eng.stats().leases_active == 0
    stale = serials.copy()
    stale[3] += 1
    before = counters(eng)
    assert eng.lookup_entries(NS, ids, stale, lease=True) is None          # one entry is not what the client saw:
    assert eng.delete(NS, keys[5:]) == 1
    assert eng.lookup_entries(NS, ids, serials, lease=True) is None        # or is gone; nothing done, nothing counted
    assert eng.lookup_entries(NS, ids[:0], serials[:0]) is None
    assert counters(eng) == before and eng.stats().leases_active == 0
    with pytest.raises(InvalidRequestError, match="entry ids"):
        eng.lookup_entries(NS, ids, serials[:2])
