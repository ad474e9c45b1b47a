"""What a router asks the daemon, once for both RPCs' front end: Annotate (vLLM identities of blocks about to be
stored, for the vLLM-format events) and PrefixScore (each live node's share of a chain).

Tenant checks as every other RPC (the namespace must be the caller's). Annotate keeps nothing when the daemon
does not publish vLLM-format events (kv_events off): the answer says so and the connector stops sending.
PrefixScore asks the peer tier when there is one (kvstore/peer/scores.py), else answers for this node alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.engine.engine import Engine
from kvstore.origins import BlockOrigin, check_origins
from kvstore.peer.scores import NodeShare, shares
from kvstore.server.tenancy import TenantGuard
from kvstore.validation import check_count, check_keys

if TYPE_CHECKING:
    from kvstore.peer.cluster import PeerCluster
    from kvstore.server.kv_events.publisher import KvEventsPublisher

__all__ = ["RoutingOps"]


class RoutingOps:
    def __init__(self, engine: Engine, guard: TenantGuard, node_id: str, control_address: str = "",
                 publisher: KvEventsPublisher | None = None, peers: PeerCluster | None = None) -> None:
        self.engine = engine
        self.guard = guard
        self.node_id = node_id
        self.control_address = control_address
        self.publisher = publisher
        self.peers = peers

    @property
    def publishing(self) -> bool:
        return self.publisher is not None

    def annotate(self, namespace: str, keys: Sequence[bytes], origins: Sequence[BlockOrigin]) -> int:
        """Keep the origins for the vLLM-format events of the keys' coming put; how many were kept (0: off)."""
        self.guard.namespace(namespace)
        cfg = self.engine.config
        check_keys(keys, cfg.max_batch_keys, max_key_bytes=cfg.max_key_bytes)
        check_origins(keys, origins)
        self.engine.tokens_per_block(namespace)  # an unknown namespace is refused (UnknownNamespaceError)
        if self.publisher is None:
            return 0
        return self.publisher.annotate(namespace, list(keys), list(origins))

    def prefix_score(self, namespace: str, keys: Sequence[bytes]) -> tuple[list[NodeShare], int]:
        """(every live member's share, this node first; the namespace's tokens per block, 0 when unknown)."""
        self.guard.namespace(namespace)
        check_count("keys", len(keys), self.engine.config.max_batch_keys)
        tokens = self.engine.tokens_per_block(namespace)
        if self.peers is not None:
            return self.peers.prefix_shares(namespace, list(keys)), tokens
        own = self.engine.tiers(namespace, list(keys))
        return shares(len(keys), {self.node_id: own}, {self.node_id: self.control_address}, self.node_id,
                      lambda node: ()), tokens
