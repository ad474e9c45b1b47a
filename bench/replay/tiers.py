"""What store a replay runs against: tiers with capacities in tokens, and the KV bytes a token costs.

One description feeds both sides, so the daemon and the simulator can never be sized differently:
`daemon_options()` for the real store and `sim_tiers()` for the model.

RAM: capacities are in TOKENS (what the paper's Fig. 9 plots) and convert to bytes exactly: arena_bytes =
capacity_tokens * bytes_per_token, one slot = one 512-token block. max_block_bytes = the block size makes every
slab exactly one slot, so the daemon holds capacity_tokens // 512 blocks, the simulator's capacity. Watermarks
high = low = 1.0: only allocation pressure evicts, one block at a time, as in an offline LRU (the default
0.95/0.90 would run the daemon ~5-10 % smaller and evict in bursts).

Disk (`DiskLayout`): disk_bytes = disk_tokens * bytes_per_token, rounded DOWN to whole segments (the unit the
daemon reclaims, FIFO). The segment size is the largest whole MiB that still gives >= 64 segments (so the
oldest-segment reclamation drops at most ~1.6 % of the tier at once, close to a block-grained FIFO), and at
least one record (the block rounded up to 4 KiB). disk_sync "none": this is a hit-rate replay, not a
durability test, so no fsync. Codec none (the stamped rows would compress to nothing and skew the bytes).
`disk_reinsert_hits` is the disk tier's second chance at reclamation (the daemon's default 1; 0 = plain FIFO),
on both sides. `policy` is the RAM tier's eviction policy (POLICIES), the daemon's `policy` option and the
simulator's RAM tier. `disk_write` (commit | evict, the daemon's default evict) and `disk_admission` (always |
seen:N | never) are the daemon's settings and the simulator's WritePlan. `disk_write_budget` (bytes per second
of the trace's clock, 0: none) is the simulator's only: the daemon's budget runs on its own clock, and a replay
runs far faster than the trace, so no daemon can be sized to the same budget (`daemon_options` refuses it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from bench.replay.sim import PAGE_BYTES, WRITER_BATCH_BLOCKS, LRUTier, PolicyTier, SegmentLog, SimTier, WritePlan
from bench.replay.trace import BLOCK_TOKENS
from kvstore.errors import ConfigError
from kvstore.policies.admission import WRITE_MODES, make_admission

__all__ = ["TierSpec", "StoreSpec", "DiskLayout", "fmt_tokens", "MIN_SEGMENTS", "POLICIES"]

TierKind = Literal["ram", "disk", "peer"]
MIB = 1 << 20
MIN_SEGMENTS = 64
# RAM eviction policies with an exact simulator: LRU (sim.LRUTier) and S3-FIFO (sim_policy.PolicyTier, which
# drives the daemon's own S3FIFOPolicy class in the engine's event order)
POLICIES = ("lru", "s3fifo")
# The write-behind queue only ever holds one put's blocks (the replayer drains it after each put); this bound
# just has to exceed the largest request, which the daemon's 4096-key batches keep far below it.
WRITE_QUEUE_BLOCKS = 1 << 16
REPLAY_TIMEOUT_S = 120.0


def fmt_tokens(n: int) -> str:
    """3000000 -> '3M', 1500000 -> '1.5M', 65536 -> '65.5K'."""
    for unit, size in (("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


@dataclass(frozen=True)
class DiskLayout:
    """How a disk budget becomes the daemon's segments, and what it then holds."""

    segment_bytes: int
    segments: int
    record_bytes: int

    @staticmethod
    def for_budget(disk_bytes: int, block_bytes: int) -> DiskLayout:
        record = -(-block_bytes // PAGE_BYTES) * PAGE_BYTES
        seg = max(MIB, disk_bytes // MIN_SEGMENTS // MIB * MIB, -(-record // MIB) * MIB)
        layout = DiskLayout(seg, disk_bytes // seg, record)
        # A write batch that needed every segment would find the oldest one in use by itself (NO_SPACE): keep
        # enough segments that one batch of the writer never spans them all.
        need = 2 + math.ceil(WRITER_BATCH_BLOCKS / (seg // record))
        if layout.segments < need:
            raise ValueError(f"disk of {disk_bytes} bytes: only {layout.segments} segments of {seg} bytes; need at "
                             f"least {need} ({need * seg} bytes) for {block_bytes}-byte blocks")
        return layout

    @property
    def capacity_bytes(self) -> int:
        return self.segments * self.segment_bytes

    @property
    def capacity_blocks(self) -> int:
        return self.segments * (self.segment_bytes // self.record_bytes)


@dataclass(frozen=True)
class TierSpec:
    kind: TierKind
    capacity_tokens: int

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // BLOCK_TOKENS


@dataclass(frozen=True)
class StoreSpec:
    tiers: tuple[TierSpec, ...]
    bytes_per_token: int = 64
    policy: str = "lru"
    disk_reinsert_hits: int = 1
    disk_write: str = "evict"
    disk_admission: str = "always"
    disk_write_budget: int = 0          # bytes per second of the trace's clock (the simulator only); 0: none
    disk_write_budget_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.disk_write not in WRITE_MODES:
            raise ValueError(f"disk_write={self.disk_write!r}: use one of {', '.join(WRITE_MODES)}")
        try:
            make_admission(self.disk_admission)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if not self.tiers or self.tiers[0].kind != "ram":
            raise ValueError("the first tier must be 'ram'")
        if [t.kind for t in self.tiers[1:]] not in ([], ["disk"]):
            raise ValueError("a store is RAM, or RAM then disk (the daemon has no peer tier yet)")
        if self.block_bytes % PAGE_BYTES:
            raise ValueError(f"bytes_per_token={self.bytes_per_token}: a {BLOCK_TOKENS}-token block must be a "
                             f"multiple of {PAGE_BYTES} bytes (the arena's page), so use a multiple of 8")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: use one of {', '.join(POLICIES)} (the policies with an "
                             "exact simulator)")
        if self.tiers[0].capacity_blocks < 2:
            raise ValueError(f"ram capacity {self.tiers[0].capacity_tokens} tokens: need at least "
                             f"{2 * BLOCK_TOKENS} (two blocks; the daemon's arena minimum)")
        _ = self.disk  # a disk budget too small for its segments fails here, before any daemon starts

    @staticmethod
    def ram(capacity_tokens: int, bytes_per_token: int = 64, policy: str = "lru") -> StoreSpec:
        return StoreSpec((TierSpec("ram", capacity_tokens),), bytes_per_token, policy)

    @staticmethod
    def ram_disk(ram_tokens: int, disk_tokens: int, bytes_per_token: int = 64, reinsert_hits: int = 1,
                 policy: str = "lru", **writes: Any) -> StoreSpec:
        """RAM alone when disk_tokens is 0; `writes`: disk_write, disk_admission, disk_write_budget[_window_s]."""
        tiers = (TierSpec("ram", ram_tokens),) + ((TierSpec("disk", disk_tokens),) if disk_tokens else ())
        return StoreSpec(tiers, bytes_per_token, policy, disk_reinsert_hits=reinsert_hits, **writes)

    def with_policy(self, policy: str) -> StoreSpec:
        """The same store under another RAM eviction policy."""
        return dataclasses.replace(self, policy=policy)

    @property
    def write_plan(self) -> WritePlan:
        """When the simulator writes the disk tier: the daemon's disk_write and admission, and the budget."""
        budget = (self.disk_write_budget, self.disk_write_budget_window_s) if self.disk_write_budget else None
        return WritePlan(self.disk_write, make_admission(self.disk_admission).threshold, budget)

    @property
    def block_bytes(self) -> int:
        return BLOCK_TOKENS * self.bytes_per_token

    @property
    def ram_tokens(self) -> int:
        return self.tiers[0].capacity_tokens

    @property
    def disk_tokens(self) -> int:
        """The disk budget asked for (0 without a disk tier); `disk.capacity_bytes` is what it became."""
        return self.tiers[1].capacity_tokens if len(self.tiers) > 1 else 0

    @property
    def disk(self) -> DiskLayout | None:
        if len(self.tiers) < 2:
            return None
        return DiskLayout.for_budget(self.disk_tokens * self.bytes_per_token, self.block_bytes)

    @property
    def label(self) -> str:
        """The plot series this store belongs to: 'RAM', 'RAM+disk'."""
        return "+".join(t.kind if t.kind != "ram" else "RAM" for t in self.tiers)

    def daemon_options(self) -> dict[str, Any]:
        """kvstore.testing.DaemonProcess options (= kvstore-server flags) for this store. The disk directory is
        DaemonProcess's default: a `disk` folder in the daemon's private temporary workdir."""
        opts: dict[str, Any] = {"arena_bytes": self.ram_tokens * self.bytes_per_token,
                                   "max_block_bytes": self.block_bytes, "policy": self.policy,
                                   "high_watermark": 1.0, "low_watermark": 1.0,
                                   # a get waits this long for promotions and a Reserve for write-backs: in
                                   # lock-step a timeout is the box's load, not the store's rule (the daemon's
                                   # default 5 s timed out once in a full-scale replay at load average 12)
                                   "promote_timeout_s": REPLAY_TIMEOUT_S}
        d = self.disk
        if d is not None:
            if self.disk_write_budget:
                raise ValueError("disk_write_budget is the simulator's only: a replay runs faster than the trace, so "
                                 "no daemon budget equals it (simulate the budget; replay without it)")
            opts.update(disk_bytes=d.capacity_bytes, disk_segment_bytes=d.segment_bytes, disk_sync="none",
                        disk_codec="none", disk_admission=self.disk_admission, disk_write=self.disk_write,
                        write_queue_blocks=WRITE_QUEUE_BLOCKS, disk_reinsert_hits=self.disk_reinsert_hits)
        return opts

    def sim_tiers(self) -> list[SimTier]:
        cap = self.tiers[0].capacity_blocks
        tiers: list[SimTier] = [LRUTier("ram", cap) if self.policy == "lru" else PolicyTier("ram", cap, self.policy)]
        d = self.disk
        if d is not None:
            tiers.append(SegmentLog("disk", d.segments, d.segment_bytes, self.block_bytes,
                                    reinsert_hits=self.disk_reinsert_hits))
        return tiers
