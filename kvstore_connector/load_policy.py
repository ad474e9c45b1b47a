"""Which hits load in the step that schedules them (load_mode, sync_fetch_bytes), decided per request.

Why it matters: an asynchronous load (vLLM's WAITING_FOR_REMOTE_KVS) costs the request at least one more engine
step, and a busy engine's step is far longer than a memcpy from RAM or a read of a few blocks from NVMe or a peer;
a synchronous one makes the whole step wait for what it reads. So "auto" loads in the step a hit whose blocks
off this node's RAM (on disk or at peers; blocks vLLM already holds do not count) total at most
sync_fetch_bytes, every shard's bytes together, and the rest asynchronously. A model with several KV cache
groups always loads asynchronously: vLLM takes a failed load of such a model only as a failed receive of a
request waiting for it, not block by block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore_connector.config import ConnectorConfig
from kvstore_connector.namespace import StageLayouts
from kvstore.vocab import Tier

__all__ = ["LoadPolicy"]

log = logging.getLogger(__name__)


class LoadPolicy:
    def __init__(self, config: ConnectorConfig, stages: StageLayouts, num_groups: int) -> None:
        self.mode = config.load_mode
        self.budget = config.sync_fetch_bytes
        self.tokens_per_key = stages.tokens_per_key
        self.key_bytes = sum(s.block_bytes * s.blocks_per_key for s in stages.specs)  # one key, every shard
        self.grouped = num_groups > 1
        if self.grouped and self.mode == "sync":
            log.warning("kvstore connector: load_mode \"sync\" is not available for a model with %d KV cache groups "
                        "(vLLM cannot take a failed in-step load of such a model); loading asynchronously",
                        num_groups)

    def fetch_keys(self, tiers: Sequence[int], local_tokens: int) -> int:
        """The hit keys a load must read from disk or fetch from peers: those off this node's RAM past the
        ``local_tokens`` vLLM's own prefix cache holds (a key partly in it still loads its other blocks)."""
        return sum(1 for x in tiers[local_tokens // self.tokens_per_key:] if x != Tier.RAM)

    def sync(self, fetch_keys: int) -> bool:
        """Load in the step that schedules the request, reading or fetching ``fetch_keys`` stored blocks?"""
        if self.grouped or self.mode == "async":
            return False
        return self.mode == "sync" or fetch_keys == 0 or fetch_keys * self.key_bytes <= self.budget
