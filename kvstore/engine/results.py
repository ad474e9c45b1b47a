"""Plain value objects the engine returns; the gRPC service maps them to protobuf messages by field name.

The Stats family keeps the proto's field names (proto/kvstore/v1/kvstore.proto) so kvstore.pbmap maps it with
no hand-written copy: adding a stat is one field here and one in the proto (tests/test_pbmap.py). EngineStats
is the engine's part of StatsResponse (no node identity, arena layout, peers or control socket: the daemon
gives those); NamespaceStats is the proto's NamespaceStats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvstore.arena.allocator import ClassUsage
from kvstore.engine.config import EngineConfig  # re-exported: it lived here before kvstore.engine.config
from kvstore.vocab import ReserveOutcome

if TYPE_CHECKING:
    from kvstore.policies.write_budget import BudgetState
    from kvstore.tiers.disk.types import DiskStats

__all__ = ["EngineConfig", "ReserveResult", "StoreResult", "LookupResult", "HitColumns", "KeyRecord", "NamespaceStats", "NamespaceUsage",
           "EngineStats", "DiskWriting"]

RESERVED, ALREADY_PRESENT, IN_FLIGHT = ReserveOutcome.RESERVED, ReserveOutcome.ALREADY_PRESENT, ReserveOutcome.IN_FLIGHT


@dataclass
class ReserveResult:
    reservation_id: int
    outcomes: list[int]
    offsets: list[int]
    expires_in_ms: int


@dataclass
class StoreResult:
    """A Store into spare slots (spares.py): per key its ReserveOutcome (RESERVED: stored now), how many were
    stored, and per key a new spare slot granted for the one it used (0: none, or the key was not stored and
    keeps its slot)."""
    outcomes: list[int]
    stored: int
    refill: list[int]


@dataclass(frozen=True)
class HitColumns:
    """A Lookup's hit columns as the engine holds them: the same values as LookupResult's lists, as numpy arrays.

    For encoders that write the columns as bytes: `ndarray.tobytes` takes ~1 us for 280 values, where packing
    the list back (`array('Q', list)`) takes ~3 us. Owned by the result: never written after the Lookup."""

    offsets: np.ndarray      # int64
    sizes: np.ndarray        # int64
    generations: np.ndarray  # uint64
    checksums: np.ndarray    # uint64


@dataclass(frozen=True)
class Filled:
    """What the peer tier's fill did before a leased Lookup: blocks it stored here, and the keys it found here
    already (each a copy that may be let go before the Lookup's lease takes it: Engine.lookup asks again)."""

    stored: int
    here: frozenset[bytes] = frozenset()


@dataclass
class LookupResult:
    num_prefix: int
    present: list[bool]
    offsets: list[int]
    sizes: list[int]
    generations: list[int]
    checksums: list[int]
    lease_id: int
    expires_in_ms: int
    tiers: list[int] = field(default_factory=list)
    # the four hit lists above as arrays (None when there are no hits); not compared: the lists say the same
    columns: HitColumns | None = field(default=None, compare=False, repr=False)
    # bytes a reader copied out without a lease (a probe with `read`: a get answered from the key index)
    read_bytes: int = field(default=0, compare=False)


@dataclass(frozen=True)
class KeyRecord:
    key: bytes
    size: int
    tier: str
    age_s: float
    pins: int
    leases: int
    checksum: int


@dataclass(frozen=True)
class NamespaceStats:
    """One namespace's usage (proto NamespaceStats)."""

    name: str
    model: str
    layout_digest: str
    tenant: str
    blocks: int
    bytes: int
    lookup_keys: int
    hit_keys: int
    puts: int
    tokens_per_block: int = 0   # 0: unknown
    hit_keys_disk: int = 0      # of hit_keys, found on the disk tier
    disk_bytes: int = 0         # footprint in the disk tier (page-rounded stored bytes)
    hit_keys_peer: int = 0      # of hit_keys, found on peers (Lookups without lease)

    @property
    def hit_keys_ram(self) -> int:
        return self.hit_keys - self.hit_keys_disk - self.hit_keys_peer


NamespaceUsage = NamespaceStats  # its name before it took the proto's (tests and server/tenant_usage.py import it)


@dataclass
class EngineStats:
    """The engine's part of StatsResponse, with the proto's field names (see the module docstring)."""

    policy: str
    capacity_bytes: int
    slab_bytes: int
    slabs_total: int
    slabs_free: int
    allocated_bytes: int
    stored_bytes: int
    reserved_bytes: int
    leased_bytes: int
    pinned_bytes: int
    fragmentation: float
    stranded_bytes: int
    blocks: int
    leases_active: int
    reservations_active: int
    high_watermark: float
    low_watermark: float
    counters: dict[str, int] = field(default_factory=dict)
    namespaces: list[NamespaceStats] = field(default_factory=list)
    size_classes: list[ClassUsage] = field(default_factory=list)
    disk: DiskStats | None = None  # when the disk tier is enabled (its names differ in two places: service.py)


@dataclass(frozen=True)
class DiskWriting:
    """When the disk tier is written and at what rate (the engine's part of DiskTierStats, by field name)."""

    write_mode: str                 # disk_write: commit | evict
    promotion_queue_blocks: int     # promotions started and not landed (reading, queued or waiting for room)
    writeback_blocks: int           # RAM victims being written before their slot is freed
    budget: BudgetState | None      # None: no disk_write_budget
