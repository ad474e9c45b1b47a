"""What store a replay runs against: tiers with capacities in tokens, and the KV bytes a token costs.

One description feeds both sides, so the daemon and the simulator can never be sized differently:
`daemon_options()` for the real store and `sim_tiers()` for the model. Capacities are in TOKENS (what the
paper's Fig. 9 plots) and convert to bytes exactly: arena_bytes = capacity_tokens * bytes_per_token, one slot
= one 512-token block. max_block_bytes = the block size makes every slab exactly one slot, so the daemon holds
capacity_tokens // 512 blocks, the simulator's capacity. Watermarks high = low = 1.0: only allocation
pressure evicts, one block at a time, as in an offline LRU (the default 0.95/0.90 would run the daemon ~5-10 %
smaller and evict in bursts).

The disk and peer tiers are described here already so that the CLI, the simulator and the plot series take
them unchanged; the daemon side refuses them until it has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bench.replay.sim import LRUTier, SimTier
from bench.replay.trace import BLOCK_TOKENS

__all__ = ["TierSpec", "StoreSpec", "fmt_tokens"]

TierKind = Literal["ram", "disk", "peer"]
_PAGE = 4096


def fmt_tokens(n: int) -> str:
    """3000000 -> '3M', 1500000 -> '1.5M', 65536 -> '65.5K'."""
    for unit, size in (("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


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

    def __post_init__(self) -> None:
        if not self.tiers or self.tiers[0].kind != "ram":
            raise ValueError("the first tier must be 'ram'")
        if self.block_bytes % _PAGE:
            raise ValueError(f"bytes_per_token={self.bytes_per_token}: a {BLOCK_TOKENS}-token block must be a "
                             f"multiple of {_PAGE} bytes (the arena's page), so use a multiple of 8")
        if self.policy != "lru":
            raise ValueError(f"policy={self.policy!r}: only 'lru' has an exact simulator so far")
        for t in self.tiers:
            if t.capacity_blocks < 2:
                raise ValueError(f"{t.kind} capacity {t.capacity_tokens} tokens: need at least "
                                 f"{2 * BLOCK_TOKENS} (two blocks; the daemon's arena minimum)")

    @staticmethod
    def ram(capacity_tokens: int, bytes_per_token: int = 64) -> StoreSpec:
        return StoreSpec((TierSpec("ram", capacity_tokens),), bytes_per_token)

    @property
    def block_bytes(self) -> int:
        return BLOCK_TOKENS * self.bytes_per_token

    @property
    def ram_tokens(self) -> int:
        return self.tiers[0].capacity_tokens

    @property
    def label(self) -> str:
        """The plot series this store belongs to: 'RAM', 'RAM+disk', 'RAM+disk+peer'."""
        return "+".join(t.kind if t.kind != "ram" else "RAM" for t in self.tiers)

    def daemon_options(self) -> dict[str, object]:
        """kvstore.testing.DaemonProcess options (= kvstore-server flags) for this store."""
        unsupported = [t.kind for t in self.tiers[1:]]
        if unsupported:
            raise NotImplementedError(f"the daemon has no {', '.join(unsupported)} tier yet: simulate it only")
        return {"arena_bytes": self.ram_tokens * self.bytes_per_token, "max_block_bytes": self.block_bytes,
                "policy": self.policy, "high_watermark": 1.0, "low_watermark": 1.0}

    def sim_tiers(self) -> list[SimTier]:
        return [LRUTier(t.kind, t.capacity_blocks) for t in self.tiers]
