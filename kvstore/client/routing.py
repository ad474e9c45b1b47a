"""Client.annotate and Client.prefix_score: what a router, and the vLLM connector, ask the daemon about routing.

A mixin of Client (it needs only ``self._rpc``, ``self._health`` and ``self.max_batch_keys``), gRPC only: both are
small control messages. `annotate` hands the daemon vLLM's identity of blocks about to be stored (kvstore.origins:
their vLLM block hashes, parent hash, token ids), so its vLLM-format KV events name them as vLLM would; send it
before the put of the same keys. `prefix_score` asks one daemon, which asks every live member once, how much of a
chain each node would serve from its RAM, its disk and its peers (kvstore/peer/scores.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.rpc import Rpc
from kvstore.errors import BatchTooLargeError
from kvstore.origins import BlockOrigin, check_origins

__all__ = ["RoutingCalls", "NodeScore"]


@dataclass(frozen=True)
class NodeScore:
    """One live node's share of a chain: the leading blocks it would serve from its RAM, from its disk, and
    fetched from peers (its own Lookup's answer), and the same in tokens (0 when the namespace has no
    tokens_per_block). `answered` is False for a node that did not answer in time (counted as holding nothing)."""

    node_id: str
    control_address: str
    is_self: bool
    answered: bool
    ram_blocks: int
    disk_blocks: int
    peer_blocks: int
    ram_tokens: int
    disk_tokens: int
    peer_tokens: int

    @property
    def blocks(self) -> int:
        return self.ram_blocks + self.disk_blocks + self.peer_blocks

    @property
    def tokens(self) -> int:
        return self.ram_tokens + self.disk_tokens + self.peer_tokens

    @staticmethod
    def from_pb(m: pb.NodeScore) -> NodeScore:
        return NodeScore(m.node_id, m.control_address, m.self, m.answered, m.ram_blocks, m.disk_blocks,
                         m.peer_blocks, m.ram_tokens, m.disk_tokens, m.peer_tokens)


class RoutingCalls:
    _rpc: Rpc
    _health: pb.HealthResponse
    max_batch_keys: int

    @property
    def kv_events(self) -> bool:
        """Whether the daemon publishes vLLM-format KV events (as it said on connecting): annotate is worth it."""
        return bool(self._health.kv_events)

    def annotate(self, namespace: str, keys: Sequence[bytes], origins: Sequence[BlockOrigin]) -> int:
        """Hand the daemon the vLLM identity of each key (one BlockOrigin per key, all of one block_size and LoRA
        name) before their put; returns how many it kept (0: it publishes no vLLM-format events)."""
        check_origins(keys, origins)
        if not keys:
            return 0
        if len({(o.block_size, o.lora_name) for o in origins}) > 1:
            raise ValueError("annotate: every origin of one call has the same block_size and lora_name")
        kept = 0
        for start in range(0, len(keys), self.max_batch_keys):
            part = slice(start, start + self.max_batch_keys)
            req = pb.AnnotateRequest(
                namespace=namespace, keys=list(keys[part]), block_size=origins[0].block_size,
                lora_name=origins[0].lora_name or "",
                origins=[pb.BlockOrigin(block_hashes=list(o.block_hashes), parent_block_hash=o.parent_block_hash or b"",
                                        token_ids=o.token_ids.tolist()) for o in origins[part]])
            r = self._rpc.call("Annotate", req)
            kept += r.kept
            if not r.publishing:
                break
        return kept

    def prefix_score(self, namespace: str, keys: Sequence[bytes]) -> list[NodeScore]:
        """Every live node's share of the chain `keys` (NodeScore), the node asked first: one call, metadata only
        (no lease, no lookup counted, no promotion). A chain of more than max_batch_keys keys: BatchTooLargeError
        (score its head: the blocks past it rarely decide a route)."""
        if len(keys) > self.max_batch_keys:
            raise BatchTooLargeError(f"{len(keys)} keys in one prefix score exceeds the limit of "
                                     f"{self.max_batch_keys}: score the chain's first {self.max_batch_keys} keys")
        r = self._rpc.call("PrefixScore", pb.KeysRequest(namespace=namespace, keys=list(keys)))
        return [NodeScore.from_pb(n) for n in r.nodes]
