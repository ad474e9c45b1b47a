"""Typed results of the client API (no protobuf leaks into user code).

What the daemon reports about itself (Health, Stats and their parts) lives in reports.py and is re-exported
here; this module holds the results of data operations (keys, puts, reservations, leases, events).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.reports import (ControlPlaneStats, DiskInfo, DiskTierStats, Health, NamespaceInfo,
                                    NamespaceStats, PeerInfo, PeerMember, PeerMemberInfo, PeerTierStats,
                                    SizeClassInfo, SizeClassStats, Stats, TenantInfo, TenantStats)
from kvstore.pbmap import from_message
from kvstore.vocab import TIER_NAMES, ReserveOutcome, Tier

__all__ = ["KVEvent", "TIER_NAMES", "KeyInfo", "KeyExplanation", "PutResult", "Reservation", "Lease",
           # reports.py, re-exported: the proto's names, then the older ones kept as aliases
           "Health", "Stats", "PeerTierStats", "PeerMember", "DiskTierStats", "NamespaceStats", "SizeClassStats",
           "TenantStats", "ControlPlaneStats",
           "PeerInfo", "PeerMemberInfo", "DiskInfo", "NamespaceInfo", "SizeClassInfo", "TenantInfo"]


@dataclass(frozen=True)
class KeyInfo:
    key: bytes
    size: int
    tier: str
    age_s: float
    pins: int
    leases: int
    checksum: int
    tokens: int = 0             # tokens in the block: its namespace's tokens_per_block (0: unknown)

    @staticmethod
    def from_pb(k: pb.KeyInfo) -> KeyInfo:
        return from_message(KeyInfo, k)


@dataclass(frozen=True)
class KeyExplanation:
    """Where one key lives now in its namespace, or why it is absent (Client.explain; the proto's namesake).

    cause (when tier is Tier.NONE): never_stored, evicted, disk_reclaimed, deleted, cleared or other_namespace
    (kvstore/engine/misses.py says what each means); "" when present. A key present in a tier is reported by
    its tier even when a Lookup could not load it (load_failed is counted by Lookups only)."""

    tier: Tier                              # Tier.RAM or Tier.DISK; Tier.NONE when absent
    cause: str = ""
    age_s: float = 0.0                      # seconds since it left (a recorded cause); 0.0 otherwise
    policy: str = ""                        # the eviction policy, for "evicted"
    other_namespaces: tuple[str, ...] = ()  # namespaces holding it now in RAM (with tokens: your own only)

    @property
    def present(self) -> bool:
        return self.tier != Tier.NONE

    @staticmethod
    def from_pb(m: pb.KeyExplanation) -> KeyExplanation:
        return from_message(KeyExplanation, m, tier=Tier(m.tier), other_namespaces=tuple(m.other_namespaces))


@dataclass(frozen=True)
class PutResult:
    stored: int
    already_present: int
    in_flight: int


@dataclass
class Reservation:
    """Slots to fill before `Client.commit`. `offsets[i]` is 0 unless `outcomes[i]` is ReserveOutcome.RESERVED."""

    namespace: str
    keys: list[bytes]
    id: int
    outcomes: list[int]
    offsets: list[int]
    incarnation: int

    @property
    def reserved_indices(self) -> list[int]:
        return [i for i, o in enumerate(self.outcomes) if o == ReserveOutcome.RESERVED]


@dataclass
class Lease:
    """Found blocks, leased for reading. Index i of offsets/sizes/generations is the i-th *hit*."""

    namespace: str
    num_prefix: int
    present: list[bool]
    offsets: list[int]
    sizes: list[int]
    generations: list[int]
    checksums: list[int]
    id: int
    incarnation: int
    tiers: list[int] = field(default_factory=list)  # per key looked at: a kvstore.vocab.Tier value

    @property
    def hits(self) -> int:
        return len(self.offsets)


@dataclass(frozen=True)
class KVEvent:
    """One KV event. kind: stored | removed | moved | gap. For moved, `tier` is the source, `to_tier` the target."""

    seq: int
    time: float
    node_id: str
    kind: str
    namespace: str = ""
    keys: tuple[bytes, ...] = ()
    tier: str = ""
    to_tier: str = ""
    whole_namespace: bool = False
    dropped: int = 0

    @staticmethod
    def from_pb(m: pb.KVEvent) -> KVEvent:
        kind = m.WhichOneof("event") or "gap"
        base = {"seq": m.seq, "time": m.time, "node_id": m.node_id, "kind": kind}
        if kind == "gap":
            return KVEvent(**base, dropped=m.gap.dropped)
        e = getattr(m, kind)
        if kind == "moved":
            return KVEvent(**base, namespace=e.namespace, keys=tuple(e.keys), tier=TIER_NAMES[e.from_tier],
                           to_tier=TIER_NAMES[e.to_tier])
        return KVEvent(**base, namespace=e.namespace, keys=tuple(e.keys), tier=TIER_NAMES[e.tier],
                       whole_namespace=getattr(e, "whole_namespace", False))
