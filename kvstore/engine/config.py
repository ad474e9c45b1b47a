"""EngineConfig: the engine's part of the daemon config, built and validated by kvstore.server.config."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """The engine's part of the daemon config (validated by kvstore.server.config)."""

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
    probe_interval_s: float = 5.0     # how often a degraded disk tier is retried
    disk_codec: str = "none"          # default disk-tier codec of namespaces that do not choose one
    isolate_tenants: bool = False     # one arena memory file per tenant (tokens on): slots never cross tenants
