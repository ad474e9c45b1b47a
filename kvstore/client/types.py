"""Typed results of the client API (no protobuf leaks into user code)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore._proto import kvstore_pb2 as pb

__all__ = ["KVEvent", "TIER_NAMES", "Health", "Stats", "PeerInfo", "PeerMemberInfo", "DiskInfo", "NamespaceInfo", "SizeClassInfo", "KeyInfo", "PutResult", "Reservation", "Lease"]


@dataclass(frozen=True)
class PeerMemberInfo:
    node_id: str
    control_address: str
    data_address: str
    data_plane: str
    capacity_bytes: int
    is_self: bool


@dataclass(frozen=True)
class PeerInfo:
    """The peer tier's part of Health and Stats (None when the daemon runs alone)."""

    node_id: str
    etcd_connected: bool
    data_plane: str
    data_address: str
    replication: str
    members: list[PeerMemberInfo]
    counters: dict[str, int]
    pending_pushes: int

    @staticmethod
    def from_pb(m: pb.PeerTierStats) -> PeerInfo | None:
        if not m.enabled:
            return None
        return PeerInfo(m.node_id, m.etcd_connected, m.data_plane, m.data_address, m.replication,
                        [PeerMemberInfo(p.node_id, p.control_address, p.data_address, p.data_plane, p.capacity_bytes,
                                        p.self) for p in m.members],
                        dict(sorted(m.counters.items())), m.pending_pushes)


@dataclass(frozen=True)
class Health:
    status: str
    node_id: str
    version: str
    hostname: str
    pid: int
    arena_name: str
    arena_bytes: int
    arena_locked: bool
    max_block_bytes: int
    max_batch_keys: int
    uptime_s: float
    detail: str = ""
    peers: PeerInfo | None = None
    arena_isolated: bool = False  # one arena memory file per tenant (tokens on): a client maps only its own
    client_control: str = ""      # filled in by the client: "fast" or "grpc", the path its hot operations take
    client_data: str = ""         # filled in by the client: "arena" or "stream"

    @staticmethod
    def from_pb(m: pb.HealthResponse) -> Health:
        return Health(m.status, m.node_id, m.version, m.hostname, m.pid, m.arena.shm_name, m.arena.size_bytes,
                      m.arena.locked, m.max_block_bytes, m.max_batch_keys, m.uptime_s, m.detail,
                      PeerInfo.from_pb(m.peers), m.arena.isolated)


@dataclass(frozen=True)
class NamespaceInfo:
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
class SizeClassInfo:
    slot_bytes: int
    slabs: int
    used_slots: int
    free_slots: int


@dataclass(frozen=True)
class DiskInfo:
    """The disk tier's part of Stats (enabled=False and zeros when the daemon runs without one)."""

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

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @staticmethod
    def from_pb(d: pb.DiskTierStats) -> DiskInfo:
        return DiskInfo(d.enabled, d.directory, d.capacity_bytes, d.used_bytes, d.blocks, d.segments_total,
                        d.segments_free, d.degraded, d.degraded_reason, d.bytes_written, d.bytes_read, d.raw_bytes,
                        d.stored_bytes, d.checksum_failures, d.io_errors, d.evicted_blocks, d.evicted_bytes,
                        d.write_queue_blocks, d.admission)


@dataclass(frozen=True)
class TenantInfo:
    """A tenant's usage against its quotas (0 quota: none); with a token, Stats carries your tenant only."""

    tenant: str
    ram_bytes: int
    ram_quota_bytes: int
    disk_bytes: int
    disk_quota_bytes: int


@dataclass(frozen=True)
class ControlInfo:
    """The daemon's same-node socket: where it is and what went over it."""

    socket: str
    fast_connections: int
    fast_requests: int
    fast_refused: int
    fast_frame_errors: int
    arena_files_handed: int

    @staticmethod
    def from_pb(m: pb.ControlPlaneStats) -> ControlInfo:
        return ControlInfo(m.socket, m.fast_connections, m.fast_requests, m.fast_refused, m.fast_frame_errors,
                           m.arena_files_handed)


@dataclass(frozen=True)
class Stats:
    node_id: str
    policy: str
    arena_name: str
    arena_locked: bool
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
    namespaces: list[NamespaceInfo] = field(default_factory=list)
    size_classes: list[SizeClassInfo] = field(default_factory=list)
    disk: DiskInfo | None = None
    peers: PeerInfo | None = None
    tenants: list[TenantInfo] = field(default_factory=list)
    control: ControlInfo | None = None

    @staticmethod
    def from_pb(m: pb.StatsResponse) -> Stats:
        return Stats(
            m.node_id, m.policy, m.arena.shm_name, m.arena.locked, m.capacity_bytes, m.slab_bytes, m.slabs_total,
            m.slabs_free, m.allocated_bytes, m.stored_bytes, m.reserved_bytes, m.leased_bytes, m.pinned_bytes,
            m.fragmentation, m.stranded_bytes, m.blocks, m.leases_active, m.reservations_active, m.high_watermark,
            m.low_watermark, m.uptime_s, dict(m.counters),
            [NamespaceInfo(n.name, n.model, n.layout_digest, n.tenant, n.blocks, n.bytes, n.lookup_keys,
                           n.hit_keys, n.puts, n.tokens_per_block, n.hit_keys_disk, n.disk_bytes,
                           n.hit_keys_peer)
             for n in m.namespaces],
            [SizeClassInfo(c.slot_bytes, c.slabs, c.used_slots, c.free_slots) for c in m.size_classes],
            DiskInfo.from_pb(m.disk) if m.disk.enabled else None,
            PeerInfo.from_pb(m.peers),
            [TenantInfo(t.tenant, t.ram_bytes, t.ram_quota_bytes, t.disk_bytes, t.disk_quota_bytes) for t in m.tenants],
            ControlInfo.from_pb(m.control),
        )


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
        return KeyInfo(k.key, k.size, k.tier, k.age_s, k.pins, k.leases, k.checksum, k.tokens)


@dataclass(frozen=True)
class PutResult:
    stored: int
    already_present: int
    in_flight: int


@dataclass
class Reservation:
    """Slots to fill before `Client.commit`. `offsets[i]` is 0 unless `outcomes[i]` is RESERVED (0)."""

    namespace: str
    keys: list[bytes]
    id: int
    outcomes: list[int]
    offsets: list[int]
    incarnation: int

    @property
    def reserved_indices(self) -> list[int]:
        return [i for i, o in enumerate(self.outcomes) if o == 0]


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
    tiers: list[int] = field(default_factory=list)  # per key looked at: 0 miss, 1 RAM, 2 disk (see Tier)

    @property
    def hits(self) -> int:
        return len(self.offsets)


TIER_NAMES = {0: "none", 1: "ram", 2: "disk", 3: "peer"}


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
