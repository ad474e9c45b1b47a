"""What the daemon reports about itself (Health, Stats and their parts), typed, with the proto's names.

Every class here is its proto message's namesake and keeps its field names (proto/kvstore/v1/kvstore.proto),
so kvstore.pbmap maps the message onto it by name: adding a stat is one proto field plus one field here. The
exceptions are spelled out where they are declared: `metadata=wire(...)` for a field that flattens a sub-message
(`arena_name` is `arena.shm_name`) or cannot use the proto's name (`is_self`), `metadata=LOCAL` for a field the
client fills in itself. A sub-report typed `X | None` is None when its tier is off (`enabled` false).

Older names stay as aliases, since user code and the CLI's JSON readers know them: NamespaceInfo,
SizeClassInfo, DiskInfo, PeerInfo, PeerMemberInfo, TenantInfo (the JSON output's keys never changed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore._proto import kvstore_pb2 as pb
from kvstore.pbmap import LOCAL, from_message, wire

__all__ = ["Health", "Stats", "PeerTierStats", "PeerMember", "DiskTierStats", "DiskWriteBudgetStats", "NamespaceStats",
           "SizeClassStats", "TenantStats", "ControlPlaneStats",
           "NamespaceInfo", "SizeClassInfo", "DiskInfo", "PeerInfo", "PeerMemberInfo", "TenantInfo"]


@dataclass(frozen=True)
class PeerMember:
    node_id: str
    control_address: str
    data_address: str
    data_plane: str
    capacity_bytes: int
    is_self: bool = field(metadata=wire("self"))  # the proto's `self`: a name Python keeps for the instance


@dataclass(frozen=True)
class PeerTierStats:
    """The peer tier's part of Health and Stats (None when the daemon runs alone)."""

    node_id: str
    etcd_connected: bool
    data_plane: str
    data_address: str
    replication: str
    members: list[PeerMember]
    counters: dict[str, int]
    pending_pushes: int
    pending_handoffs: int = 0  # hand-off passes queued or running after membership changes
    settled: bool = False      # no earlier member set to ask: reads ask each block's owners only


@dataclass(frozen=True)
class Health:
    status: str
    node_id: str
    version: str
    hostname: str
    pid: int
    arena_name: str = field(metadata=wire("arena.shm_name"))
    arena_bytes: int = field(metadata=wire("arena.size_bytes"))
    arena_locked: bool = field(metadata=wire("arena.locked"))
    max_block_bytes: int
    max_batch_keys: int
    uptime_s: float
    detail: str = ""
    peers: PeerTierStats | None = None
    arena_isolated: bool = field(default=False, metadata=wire("arena.isolated"))  # one arena file per tenant
    tenant: str = ""  # the tenant this client's token belongs to ("" without tokens)
    kv_events: bool = False  # the daemon publishes vLLM-format KV events (kv_events)
    # filled in by the client: "fast" or "grpc" (the path its hot operations take), "arena" or "stream",
    # "index" or "daemon" (whether its prefix probes read the shared key index first)
    client_control: str = field(default="", metadata=LOCAL)
    client_data: str = field(default="", metadata=LOCAL)
    client_probe: str = field(default="", metadata=LOCAL)

    @staticmethod
    def from_pb(m: pb.HealthResponse) -> Health:
        return from_message(Health, m)


@dataclass(frozen=True)
class NamespaceStats:
    name: str
    model: str
    layout_digest: str
    tenant: str
    blocks: int
    bytes: int
    lookup_keys: int
    hit_keys: int
    puts: int
    tokens_per_block: int = 0   # 0: unknown (registered without it)
    hit_keys_disk: int = 0      # of hit_keys, those the disk tier held
    disk_bytes: int = 0         # footprint in the disk tier
    hit_keys_peer: int = 0      # of hit_keys, those peers held (Lookups without lease)

    @property
    def hit_rate(self) -> float:
        return self.hit_keys / self.lookup_keys if self.lookup_keys else 0.0

    @property
    def hit_keys_ram(self) -> int:
        return self.hit_keys - self.hit_keys_disk - self.hit_keys_peer

    @property
    def lookup_tokens(self) -> int | None:
        """Tokens asked for in lookups; None when tokens_per_block is unknown."""
        return self.lookup_keys * self.tokens_per_block if self.tokens_per_block else None

    @property
    def hit_tokens(self) -> int | None:
        """Tokens found (any tier); None when tokens_per_block is unknown."""
        return self.hit_keys * self.tokens_per_block if self.tokens_per_block else None


@dataclass(frozen=True)
class SizeClassStats:
    slot_bytes: int
    slabs: int
    used_slots: int
    free_slots: int


@dataclass(frozen=True)
class DiskTierStats:
    """The disk tier's part of Stats (Stats.disk is None when the daemon runs without one)."""

    enabled: bool
    directory: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    segments_total: int
    segments_free: int
    degraded: bool
    degraded_reason: str
    bytes_written: int
    bytes_read: int
    raw_bytes: int
    stored_bytes: int
    checksum_failures: int
    io_errors: int
    evicted_blocks: int
    evicted_bytes: int
    write_queue_blocks: int
    admission: str
    write_mode: str = ""              # disk_write: commit | evict
    promotion_queue_blocks: int = 0   # promotions started and not landed
    writeback_blocks: int = 0         # RAM victims being written before their slot is freed
    budget: DiskWriteBudgetStats | None = None  # None: no disk_write_budget

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass(frozen=True)
class DiskWriteBudgetStats:
    """The disk write budget's state (kvstore/policies/write_budget.py): totals and the current window."""

    bytes_per_s: int
    window_s: float
    probability: float
    window_admitted: int
    window_target: int
    admitted_bytes: int
    admitted_blocks: int
    refused_bytes: int
    refused_blocks: int


@dataclass(frozen=True)
class TenantStats:
    """A tenant's usage against its quotas (0 quota: none); with a token, Stats carries your tenant only."""

    tenant: str
    ram_bytes: int
    ram_quota_bytes: int
    disk_bytes: int
    disk_quota_bytes: int


@dataclass(frozen=True)
class ControlPlaneStats:
    """The daemon's same-node socket: where it is and what went over it."""

    socket: str
    fast_connections: int
    fast_requests: int
    fast_refused: int
    fast_frame_errors: int
    arena_files_handed: int


@dataclass(frozen=True)
class Stats:
    """The daemon's StatsResponse (its arena flattened into arena_name, arena_locked)."""

    node_id: str
    policy: str
    arena_name: str = field(metadata=wire("arena.shm_name"))
    arena_locked: bool = field(metadata=wire("arena.locked"))
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
    uptime_s: float
    counters: dict[str, int] = field(default_factory=dict)
    namespaces: list[NamespaceStats] = field(default_factory=list)
    size_classes: list[SizeClassStats] = field(default_factory=list)
    disk: DiskTierStats | None = None
    peers: PeerTierStats | None = None
    tenants: list[TenantStats] = field(default_factory=list)
    control: ControlPlaneStats | None = None

    @staticmethod
    def from_pb(m: pb.StatsResponse) -> Stats:
        return from_message(Stats, m)


# the names these had before they took the proto's (public: kvstore.NamespaceInfo, kvstore.client.SizeClassInfo)
NamespaceInfo = NamespaceStats
SizeClassInfo = SizeClassStats
DiskInfo = DiskTierStats
PeerInfo = PeerTierStats
PeerMemberInfo = PeerMember
TenantInfo = TenantStats
