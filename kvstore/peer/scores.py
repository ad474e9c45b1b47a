"""A prefix score per node: for every live member, the leading blocks of a chain it would serve from its RAM, from
its disk, and from peers (the blocks its own Lookup would fetch), what a router that does not consume KV events
scores a prompt by (PrefixScore RPC, Client.prefix_score, `kvstore score`).

One call, metadata only: the node asked probes every other member once for each key's tier (a tiers probe:
plane.probe_tiers_many, pipelined on the tcp plane: one round trip to all), looks its own tiers up, and computes
here, for each member N:

    walking the chain from its first block, a block counts
      ram   when N holds it in RAM
      disk  when N holds it on disk only (or it is being promoted)
      peer  when N holds it nowhere but a member N's own Lookup would ask holds it (placement.read_orders as
            N: the block's owner, then, during a hand-off window, its previous owners)
    and the prefix ends at the first block that is none of these.

So a node's total (ram + disk + peer) is the prefix its vLLM would load instead of computing, and ram, disk and
peer say how fast. The read orders come from this node's view of the member set (the same everywhere but during
a change). A member that does not answer within peer_timeout_s counts as holding nothing (`answered` false).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.vocab import Tier

__all__ = ["NodeShare", "shares"]

_HELD = (int(Tier.RAM), int(Tier.DISK))


@dataclass(frozen=True)
class NodeShare:
    """One member's share of a chain (the proto's NodeScore without tokens)."""

    node_id: str
    control_address: str
    is_self: bool
    answered: bool
    ram_blocks: int
    disk_blocks: int
    peer_blocks: int

    @property
    def blocks(self) -> int:
        return self.ram_blocks + self.disk_blocks + self.peer_blocks


def shares(keys: int, tiers: dict[str, list[int] | None], addresses: dict[str, str], me: str,
           orders_of: Callable[[str], Sequence[Sequence[str]]]) -> list[NodeShare]:
    """`tiers[node]`: each key's tier at that node (None: it did not answer); `orders_of(node)`: per key, the
    members that node's Lookup would ask, in order (placement.read_orders with me=node). This node first, then
    the others by node id."""
    out = []
    for node in sorted(tiers, key=lambda n: (n != me, n)):
        own = tiers[node]
        orders = orders_of(node) if len(tiers) > 1 else [()] * keys
        counts = [0, 0, 0]
        for i in range(keys):
            t = own[i] if own is not None else 0
            if t in _HELD:
                counts[t - 1] += 1
            elif any((tiers.get(m) or [0] * keys)[i] in _HELD for m in orders[i]):
                counts[2] += 1
            else:
                break
        out.append(NodeShare(node, addresses.get(node, ""), node == me, own is not None, *counts))
    return out
