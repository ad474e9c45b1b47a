"""kvstore.vocab's IntEnums must equal the proto's enums, name for name and value for value."""

from __future__ import annotations

from kvstore._proto import kvstore_pb2 as pb
from kvstore.vocab import TIER_NAMES, ReserveOutcome, Tier


def _proto_enum(name: str) -> dict[str, int]:
    desc = pb.DESCRIPTOR.enum_types_by_name[name]
    return {v.name: v.number for v in desc.values}


def test_tier_equals_proto() -> None:
    assert {f"TIER_{t.name}": int(t) for t in Tier} == _proto_enum("Tier")


def test_reserve_outcome_equals_proto() -> None:
    assert {o.name: int(o) for o in ReserveOutcome} == _proto_enum("ReserveOutcome")


def test_tier_names() -> None:
    assert TIER_NAMES == {0: "none", 1: "ram", 2: "disk", 3: "peer"}
