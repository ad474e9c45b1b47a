"""Annotate's and PrefixScore's protobuf messages <-> kvstore's values (kvstore.origins, kvstore.peer.scores)."""

from __future__ import annotations

from array import array

from kvstore._proto import kvstore_pb2 as pb
from kvstore.origins import BlockOrigin
from kvstore.peer.scores import NodeShare

__all__ = ["origins_of", "node_score"]


def origins_of(request: pb.AnnotateRequest) -> list[BlockOrigin]:
    """One BlockOrigin per key (checked by the caller: kvstore.origins.check_origins)."""
    lora = request.lora_name or None
    return [BlockOrigin(tuple(o.block_hashes), o.parent_block_hash or None, array("q", o.token_ids),
                        request.block_size, lora) for o in request.origins]


def node_score(n: NodeShare, tokens_per_block: int) -> pb.NodeScore:
    t = tokens_per_block
    return pb.NodeScore(node_id=n.node_id, control_address=n.control_address, self=n.is_self, answered=n.answered,
                        ram_blocks=n.ram_blocks, disk_blocks=n.disk_blocks, peer_blocks=n.peer_blocks,
                        ram_tokens=n.ram_blocks * t, disk_tokens=n.disk_blocks * t, peer_tokens=n.peer_blocks * t)
