"""Configuration (r)'s router: each call goes to the node whose store would serve the longest prefix of its prompt
from its own tiers (Client.prefix_score: one call, cluster-wide, metadata only), against (d)'s round-robin over
the same two servers.

The prompt's keys are the connector's (kvstore_connector/keys.py: the namespace's tokens per stored block, key
seed 0, no LoRA), so the router needs to know nothing of vLLM; the namespace is the connector's, found in the
daemon's Stats once the first save registered it. Score: the blocks a node holds itself (RAM, then disk), then
all it would serve (peers too). A tie (nothing stored yet, or both hold the same) falls back to (d)'s
round-robin, so the two configurations differ only where the store says one node is better.

One guard, as every router weighs load against affinity: a node with more than `max_skew` calls in flight beyond
the other's does not get the call (it goes to the other, counted `balanced`). Without it, a score that favours
one node for every prompt sent 59 of 62 saturated calls to one server (with peer_local_copies = drop, the owner of
the shared system prompt's blocks holds a block more of every prompt than the other node). Blocking (one ~1 ms
gRPC call from the driver's event loop): a call's TTFT is measured from after the route.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.serve.driver import round_robin
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore_connector.keys import KeyChain, chain_root

__all__ = ["PrefixRouter"]


@dataclass
class PrefixRouter:
    """Routes over servers [0, 1]; `addresses[i]` / `node_ids[i]`: server i's daemon."""

    addresses: Sequence[str]
    node_ids: Sequence[str]
    namespace_prefix: str = "vllm/"  # the connector's namespaces; the first one registered with tokens is used
    max_skew: int = 2     # calls in flight one node may have beyond the other before the score is overruled
    decided: int = 0      # calls the scores decided
    balanced: int = 0     # calls the scores sent to a node too far ahead in calls in flight: sent to the other
    fell_back: int = 0    # calls routed round-robin (a tie, no namespace yet, an error)
    _in_flight: list[int] = field(default_factory=lambda: [0, 0])
    _client: Client | None = None
    _namespace: str = ""
    _tokens_per_key: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, sid: int, agent: int, turn: int, context: Sequence[int]) -> int:
        pick = self._best(context)
        if pick is None:
            self.fell_back += 1
            pick = round_robin(sid, agent, turn, context)
        elif self._in_flight[pick] > self._in_flight[1 - pick] + self.max_skew:
            self.balanced += 1
            pick = 1 - pick
        else:
            self.decided += 1
        self._in_flight[pick] += 1
        return pick

    def done(self, server: int) -> None:
        """The driver: a call to `server` ended."""
        self._in_flight[server] -= 1

    def _best(self, tokens: Sequence[int]) -> int | None:
        with self._lock:
            try:
                c = self._client = self._client or Client(self.addresses[0], mode="stream")
                if not self._namespace:
                    found = [n for n in c.stats().namespaces
                             if n.name.startswith(self.namespace_prefix) and n.tokens_per_block]
                    if not found:
                        return None
                    self._namespace, self._tokens_per_key = found[0].name, found[0].tokens_per_block
                t = self._tokens_per_key
                keys = KeyChain(t, 0, chain_root(0)).extend(list(tokens[:(len(tokens) - 1) // t * t]))
                scores = c.prefix_score(self._namespace, keys[:c.max_batch_keys])
            except KVStoreError:
                return None
        ranked = sorted(((s.ram_blocks + s.disk_blocks, s.blocks), s.node_id) for s in scores
                        if s.node_id in self.node_ids)
        if len(ranked) < 2 or ranked[-1][0] == ranked[-2][0]:
            return None
        return list(self.node_ids).index(ranked[-1][1])

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def summary(self) -> dict[str, int]:
        return {"decided": self.decided, "balanced": self.balanced, "round_robin": self.fell_back}
