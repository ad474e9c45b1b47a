"""kvstore.pbmap: dataclass <-> protobuf by field name.

The messages here are built at test time from descriptors (no protoc), so a test can show what adding a field
costs: one proto field + one dataclass field, and no other code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kvstore._proto import kvstore_pb2 as pb
from kvstore.arena.allocator import ClassUsage
from kvstore.client.types import Health, KeyInfo, Stats
from kvstore.engine.results import EngineStats, KeyRecord, NamespaceStats
from kvstore.pbmap import LOCAL, PbMapError, from_message, to_message, wire
from kvstore.vocab import Tier

F = descriptor_pb2.FieldDescriptorProto


def _messages(tag: str, extra: bool = False) -> tuple[Any, Any]:
    """(Outer, Inner) message classes of a fresh file; `extra` adds `uint64 added = 20` to Outer."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"{tag}.proto", package=tag, syntax="proto3")
    enum = fdp.enum_type.add(name="Tier")
    for i, name in enumerate(("TIER_NONE", "TIER_RAM", "TIER_DISK")):
        enum.value.add(name=name, number=i)
    inner = fdp.message_type.add(name="Inner")
    for n, (name, typ) in enumerate((("a", F.TYPE_UINT64), ("b", F.TYPE_STRING), ("enabled", F.TYPE_BOOL)), 1):
        inner.field.add(name=name, number=n, type=typ, label=F.LABEL_OPTIONAL)
    outer = fdp.message_type.add(name="Outer")
    scalars = (("name", F.TYPE_STRING), ("count", F.TYPE_UINT64), ("ratio", F.TYPE_DOUBLE), ("self", F.TYPE_BOOL))
    for n, (name, typ) in enumerate(scalars, 1):
        outer.field.add(name=name, number=n, type=typ, label=F.LABEL_OPTIONAL)
    outer.field.add(name="nums", number=5, type=F.TYPE_UINT64, label=F.LABEL_REPEATED)
    outer.field.add(name="tier", number=6, type=F.TYPE_ENUM, type_name=f".{tag}.Tier", label=F.LABEL_OPTIONAL)
    for n, name in ((7, "inner"), (8, "opt")):
        outer.field.add(name=name, number=n, type=F.TYPE_MESSAGE, type_name=f".{tag}.Inner", label=F.LABEL_OPTIONAL)
    outer.field.add(name="items", number=9, type=F.TYPE_MESSAGE, type_name=f".{tag}.Inner", label=F.LABEL_REPEATED)
    for n, (name, typ, type_name) in enumerate((("counters", F.TYPE_UINT64, ""),
                                                ("by_name", F.TYPE_MESSAGE, f".{tag}.Inner")), 10):
        entry_name = "".join(p.title() for p in name.split("_")) + "Entry"
        entry = outer.nested_type.add(name=entry_name)
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        value = entry.field.add(name="value", number=2, type=typ, label=F.LABEL_OPTIONAL)
        if type_name:
            value.type_name = type_name
        outer.field.add(name=name, number=n, type=F.TYPE_MESSAGE, type_name=f".{tag}.Outer.{entry_name}",
                        label=F.LABEL_REPEATED)
    if extra:
        outer.field.add(name="added", number=20, type=F.TYPE_UINT64, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{tag}.Outer")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{tag}.Inner")))


Outer, Inner = _messages("v1")
Outer2, _ = _messages("v2", extra=True)


@dataclass(frozen=True)
class In:
    a: int
    b: str
    enabled: bool = True


@dataclass(frozen=True)
class Out:
    name: str
    count: int
    ratio: float
    is_self: bool = field(default=False, metadata=wire("self"))  # `self`: a name Python keeps for the instance
    nums: list[int] = field(default_factory=list)
    tier: int = Tier.NONE
    inner: In | None = None
    opt: In | None = None
    items: list[In] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    by_name: dict[str, In] = field(default_factory=dict)
    seen_by: str = field(default="", metadata=LOCAL)  # filled in by the receiver, never on the wire


@dataclass(frozen=True)
class Out2(Out):
    added: int = 0                                # the new stat: this line and the proto field, nothing else


def _sample(cls: type = Out, **more: object) -> Out:
    return cls(name="ns", count=7, ratio=0.25, is_self=True, nums=[3, 1, 2], tier=Tier.DISK, inner=In(5, "x"),
               opt=None, items=[In(1, "p"), In(2, "q", False)], counters={"b": 2, "a": 1},
               by_name={"k": In(9, "z")}, **more)


def test_round_trip_maps_every_kind_of_field_by_name() -> None:
    obj = _sample()
    msg = to_message(obj, Outer)
    assert (msg.name, msg.count, msg.ratio, msg.self, list(msg.nums), msg.tier) == \
        ("ns", 7, 0.25, True, [3, 1, 2], 2)
    assert (msg.inner.a, msg.inner.b, msg.HasField("opt")) == (5, "x", False)
    assert [(i.a, i.b, i.enabled) for i in msg.items] == [(1, "p", True), (2, "q", False)]
    assert dict(msg.counters) == {"a": 1, "b": 2} and msg.by_name["k"].a == 9
    back = from_message(Out, Outer.FromString(msg.SerializeToString()))
    assert back == obj
    assert list(back.counters) == ["a", "b"]  # maps come back sorted by key


def test_adding_a_field_needs_one_proto_field_and_one_dataclass_field() -> None:
    obj = _sample(Out2, added=42)
    msg = to_message(obj, Outer2)
    assert msg.added == 42
    assert from_message(Out2, msg) == obj
    # the old dataclass still reads the new message (a view of part of it); the new one cannot pretend
    assert from_message(Out, msg) == _sample()
    with pytest.raises(PbMapError, match=r"Out2\.added has no field 'added' in message v1\.Outer: add it to "
                                         r"proto/kvstore/v1/kvstore\.proto"):
        to_message(obj, Outer)
    with pytest.raises(PbMapError, match=r"Out2\.added has no field 'added' in message v1\.Outer"):
        from_message(Out2, Outer())


def test_optional_sub_message_is_none_when_unset_or_disabled() -> None:
    assert from_message(Out, Outer(name="n")).inner is None
    assert from_message(Out, Outer(inner=Inner(a=1, enabled=False))).inner is None
    assert from_message(Out, Outer(inner=Inner(a=1, enabled=True))).inner == In(1, "", True)


def test_given_fills_and_overrides_and_is_checked() -> None:
    msg = to_message(_sample(), Outer, count=99, opt=In(4, "g"), items=[Inner(a=8)])
    assert (msg.count, msg.opt.a, [i.a for i in msg.items]) == (99, 4, [8])
    got = from_message(Out, msg, seen_by="me", name="other")
    assert (got.seen_by, got.name, got.count) == ("me", "other", 99)
    with pytest.raises(PbMapError, match=r"v1\.Outer has no field 'cnt' \(given to to_message\)"):
        to_message(_sample(), Outer, cnt=1)
    with pytest.raises(PbMapError, match=r"Out has no field 'cnt' \(given to from_message\)"):
        from_message(Out, msg, cnt=1)


def test_ignore_leaves_out_fields_not_meant_for_the_wire() -> None:
    msg = to_message(_sample(Out2, added=3), Outer, ignore=("added",))
    assert msg.name == "ns" and msg.count == 7


def test_a_mismatched_nested_dataclass_is_named() -> None:
    @dataclass
    class Bad:
        a: int
        c: int

    with pytest.raises(PbMapError, match=r"Bad\.c has no field 'c' in message v1\.Inner"):
        to_message(dataclasses.replace(_sample(), inner=Bad(1, 2)), Outer)  # type: ignore[arg-type]  # on purpose


def test_dotted_wire_path_reads_a_sub_message() -> None:
    @dataclass
    class Flat:
        inner_a: int = field(metadata=wire("inner.a"))
        name: str = ""

    assert from_message(Flat, Outer(name="n", inner=Inner(a=6))) == Flat(6, "n")
    with pytest.raises(PbMapError, match=r"Wrong\.inner_a has no field 'inner\.zz'"):
        @dataclass
        class Wrong:
            inner_a: int = field(metadata=wire("inner.zz"))
        from_message(Wrong, Outer())


# -- the real Stats family: one vocabulary on the engine, the wire and the client ---------------------------
def test_engine_stats_and_client_stats_share_the_protos_names() -> None:
    ns = NamespaceStats("m", "llama", "d", "t", blocks=2, bytes=100, lookup_keys=5, hit_keys=3, puts=2,
                        tokens_per_block=16, hit_keys_disk=1, disk_bytes=4096, hit_keys_peer=1)
    es = EngineStats("lru", 1 << 20, 1 << 16, 16, 15, 4096, 100, 0, 100, 0, 0.5, 8192, 2, 1, 0, 0.9, 0.8,
                     counters={"evictions": 4, "lookup_keys": 5}, namespaces=[ns],
                     size_classes=[ClassUsage(4096, 1, 1, 15)])
    msg = to_message(es, pb.StatsResponse, node_id="n1", uptime_s=2.5,
                     arena=pb.ArenaInfo(shm_name="kv", locked=True))
    st = from_message(Stats, pb.StatsResponse.FromString(msg.SerializeToString()))
    shared = {f.name for f in dataclasses.fields(EngineStats)} - {"disk"}
    assert shared <= {f.name for f in dataclasses.fields(Stats)}
    for name in shared - {"namespaces", "size_classes"}:
        assert getattr(st, name) == getattr(es, name), name
    assert [dataclasses.asdict(n) for n in st.namespaces] == [dataclasses.asdict(ns)]
    assert [dataclasses.astuple(c) for c in st.size_classes] == [(4096, 1, 1, 15)]
    assert (st.node_id, st.uptime_s, st.arena_name, st.arena_locked, st.disk, st.peers) == \
        ("n1", 2.5, "kv", True, None, None)


def test_health_and_key_info_map_from_the_wire() -> None:
    m = pb.HealthResponse(status="SERVING", node_id="n", version="1", hostname="h", pid=3, max_block_bytes=9,
                          max_batch_keys=4, uptime_s=1.5, arena=pb.ArenaInfo(shm_name="a", size_bytes=64,
                                                                             locked=True, isolated=True))
    h = Health.from_pb(m)
    assert (h.arena_name, h.arena_bytes, h.arena_locked, h.arena_isolated, h.peers, h.client_control) == \
        ("a", 64, True, True, None, "")
    rec = KeyRecord(b"k", 10, "ram", 0.5, 1, 2, 77)
    info = KeyInfo.from_pb(to_message(rec, pb.KeyInfo, tokens=16))
    assert info == KeyInfo(b"k", 10, "ram", 0.5, 1, 2, 77, 16)


def test_disk_stats_cross_the_wire_by_name_with_their_two_renames() -> None:
    from kvstore.client.reports import DiskTierStats
    from kvstore.engine.results import DiskWriting
    from kvstore.policies.write_budget import BudgetState
    from kvstore.server.service import disk_tier_stats
    from kvstore.tiers.disk.types import DiskStats

    values = {f.name: i + 1 for i, f in enumerate(dataclasses.fields(DiskStats))}
    values.update(degraded=True, degraded_reason="full", direct_io=True)
    d = DiskStats(**values)  # type: ignore[arg-type]  # ints for every numeric field, on purpose distinct
    budget = BudgetState(1 << 20, 60.0, 0.25, 3, 4, 5, 6, 7, 8)
    got = from_message(DiskTierStats, disk_tier_stats(d, "/var/kv", 7, "always", DiskWriting("evict", 9, 10, budget)))
    want = {f.name: values.get(f.name) for f in dataclasses.fields(DiskTierStats)}
    want.update(enabled=True, directory="/var/kv", raw_bytes=d.raw_bytes, stored_bytes=d.stored_bytes,
                write_queue_blocks=7, admission="always", write_mode="evict", promotion_queue_blocks=9,
                writeback_blocks=10, budget=dataclasses.asdict(budget))
    assert dataclasses.asdict(got) == want
    none = from_message(DiskTierStats, disk_tier_stats(d, "/var/kv", 7, "always", DiskWriting("commit", 0, 0, None)))
    assert (none.write_mode, none.budget) == ("commit", None)
