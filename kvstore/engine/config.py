"""EngineConfig: the engine's part of the daemon config, with the rules on its own settings.

ServerConfig (kvstore/server/config/) builds it (`ServerConfig.engine_config`); the checks below are the only
place these rules live, and each message names the daemon setting a user would change. Rules that tie the
engine to another part (arena_bytes against max_block_bytes, the default disk codec) are checked where both
are known: server/config/rules.py and tiers/disk/config.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["EngineConfig"]

PAGE = 4096  # slots are page-aligned: the O_DIRECT disk tier reads straight into them


@dataclass(frozen=True)
class EngineConfig:
    """The engine's part of the daemon config; a bad value raises ConfigError at construction."""

    max_block_bytes: int
    max_batch_keys: int = 4096
    max_key_bytes: int = 64
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    lease_ttl_s: float = 30.0
    reservation_ttl_s: float = 30.0
    quarantine_s: float = 30.0
    promote_timeout_s: float = 5.0    # how long a get waits for blocks being read back from disk
    write_queue_blocks: int = 4096    # write-behind queue bound (blocks); beyond it blocks are not copied to disk
    probe_interval_s: float = 5.0     # how often a degraded disk tier is retried (rule: tiers/disk/config.py)
    disk_codec: str = "none"          # default disk-tier codec of namespaces that do not choose one (rule: disk)
    isolate_tenants: bool = False     # one arena memory file per tenant (tokens on): slots never cross tenants
    miss_ledger_keys: int = 262144    # keys that left the store remembered with why (misses.py); 0: none
    hint_max_ttl_s: float = 600.0     # longest Retain or Pin a hint may ask for; longer ones are clipped (hints.py)
    claim_keys: int = 1 << 18         # keys schedulers may hold claims on at once (claims.py); 0: no claims

    def __post_init__(self) -> None:
        _require(self.max_block_bytes >= PAGE and self.max_block_bytes % PAGE == 0,
                 f"max_block_bytes={self.max_block_bytes}: use a multiple of 4096 (e.g. 16MiB)")
        _require(0 < self.low_watermark <= self.high_watermark <= 1,
                 f"watermarks low={self.low_watermark} high={self.high_watermark}: need 0 < low <= high <= 1")
        for name in ("lease_ttl_s", "reservation_ttl_s"):
            _require(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be > 0")
        _require(1 <= self.max_batch_keys <= 65536, f"max_batch_keys={self.max_batch_keys}: use 1..65536")
        _require(self.promote_timeout_s > 0, f"promote_timeout_s={self.promote_timeout_s} must be > 0")
        _require(1 <= self.write_queue_blocks <= 1 << 20,
                 f"write_queue_blocks={self.write_queue_blocks}: use 1..1048576")
        _require(0 <= self.miss_ledger_keys <= 1 << 24,
                 f"miss_ledger_keys={self.miss_ledger_keys}: use 0..16777216 (0 keeps no record of why keys left)")
        _require(0 <= self.claim_keys <= 1 << 24,
                 f"claim_keys={self.claim_keys}: use 0..16777216 (0 records no claim: every scheduler computes)")
        _require(0 < self.hint_max_ttl_s <= 86400,
                 f"hint_max_ttl_s={self.hint_max_ttl_s}: use a number of seconds in (0, 86400]")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError("invalid config: " + message)
