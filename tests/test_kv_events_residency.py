"""Residency (kvstore/server/kv_events/residency.py) on values: what vLLM events the engine's events mean when
namespaces share a topic, when a block is renamed, and when the disk keeps a copy. Commented scripts, exact."""

from __future__ import annotations

from kvstore.engine.events import MOVED, REMOVED, STORED, Event
from kvstore.origins import BlockOrigin
from kvstore.server.kv_events.residency import Residency
from kvstore.server.kv_events.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.vocab import Tier

RAM, DISK = int(Tier.RAM), int(Tier.DISK)


def o(i: int) -> BlockOrigin:
    return BlockOrigin.of([b"h%d" % i], b"h%d" % (i - 1) if i else None, [i] * 2, 2)


def ev(kind: str, ns: str, keys: list[bytes], tier: int, to: int = 0, whole: bool = False) -> Event:
    return Event(0, 0.0, kind, ns, tuple(keys), tier, to, whole)


def stored(hashes: list[bytes], medium: str, parent: bytes | None = None, tokens: tuple = ()) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tokens, 2, medium, None, "kvstore")


def test_two_namespaces_of_one_topic_announce_a_hash_once_and_remove_it_with_the_last() -> None:
    """TP ranks 0 and 1 of one model: two namespaces, one topic, the same vLLM hashes."""
    pending = {("r0", b"k0"): o(0), ("r0", b"k1"): o(1), ("r1", b"k0"): o(0), ("r1", b"k1"): o(1)}
    r = Residency(lambda ns: "kv@n@m", lambda ns, k: pending.pop((ns, k), None))
    assert r.apply(ev(STORED, "r0", [b"k0", b"k1"], RAM)) == [
        ("kv@n@m", stored([b"h0", b"h1"], "CPU", None, (0, 0, 1, 1)))]
    assert r.apply(ev(STORED, "r1", [b"k0", b"k1"], RAM)) == []          # held on this topic already
    assert r.apply(ev(REMOVED, "r0", [b"k1"], RAM)) == []                # rank 1 still holds h1
    assert r.apply(ev(REMOVED, "r1", [b"k1"], RAM)) == [("kv@n@m", BlockRemoved((b"h1",), "CPU"))]
    # an eviction of a block the disk keeps: out of RAM, onto disk; a promotion: back in RAM, still on disk
    assert r.apply(ev(MOVED, "r0", [b"k0"], RAM, DISK)) == [("kv@n@m", stored([b"h0"], "STORAGE", None, (0, 0)))]
    assert r.apply(ev(MOVED, "r1", [b"k0"], RAM, DISK)) == [("kv@n@m", BlockRemoved((b"h0",), "CPU"))]
    assert r.apply(ev(MOVED, "r1", [b"k0"], DISK, RAM)) == [("kv@n@m", stored([b"h0"], "CPU", None, (0, 0)))]
    # clearing r0 leaves r1's blocks: no AllBlocksCleared, only what r0 alone held (nothing)
    assert r.apply(ev(REMOVED, "r0", [], RAM, whole=True)) == []
    assert r.apply(ev(REMOVED, "r0", [], DISK, whole=True)) == []
    assert (r.media("r1", b"k0"), len(r)) == (3, 1)
    # clearing r1, the last: its RAM copy leaves first, then the topic is empty: AllBlocksCleared
    assert r.apply(ev(REMOVED, "r1", [b"k0"], RAM)) == [("kv@n@m", BlockRemoved((b"h0",), "CPU"))]
    assert r.apply(ev(REMOVED, "r1", [], RAM, whole=True)) == []        # the disk still holds h0
    assert r.apply(ev(REMOVED, "r1", [], DISK, whole=True)) == [("kv@n@m", AllBlocksCleared())]
    assert len(r) == 0 and r.topics() == []


def test_a_block_named_by_its_key_is_renamed_when_its_identity_arrives() -> None:
    r = Residency(lambda ns: "t", lambda ns, k: None)
    assert r.apply(ev(STORED, "n", [b"k0", b"k1"], RAM)) == [
        ("t", BlockStored((b"k0", b"k1"), None, (), 0, "CPU", None, "kvstore-key"))]
    assert r.apply(ev(STORED, "n", [b"k0"], DISK)) == [
        ("t", BlockStored((b"k0",), None, (), 0, "STORAGE", None, "kvstore-key"))]
    # k0's vLLM identity after its put: the key's name leaves both media, the hash arrives in both
    assert r.annotate("n", b"k0", o(0)) == [
        ("t", BlockRemoved((b"k0",), "CPU", "kvstore-key")), ("t", BlockRemoved((b"k0",), "STORAGE", "kvstore-key")),
        ("t", stored([b"h0"], "CPU", None, (0, 0))), ("t", stored([b"h0"], "STORAGE", None, (0, 0)))]
    assert r.annotate("n", b"k0", o(0)) == []      # the same again: nothing
    assert r.annotate("n", b"nope", o(3)) == []    # not held: the store's event will take it (origin_of)


def test_a_chain_breaks_into_runs_where_its_blocks_do_not_follow_each_other() -> None:
    ids = {b"a": o(0), b"b": o(1), b"c": o(5), b"d": None}
    r = Residency(lambda ns: "t", lambda ns, k: ids[k])
    assert r.apply(ev(STORED, "n", [b"a", b"b", b"c", b"d"], RAM)) == [
        ("t", stored([b"h0", b"h1"], "CPU", None, (0, 0, 1, 1))),
        ("t", stored([b"h5"], "CPU", b"h4", (5, 5))),
        ("t", BlockStored((b"d",), None, (), 0, "CPU", None, "kvstore-key"))]
