"""The scheduler's lookup of a prompt's prefix across every shard of a model, in one pipelined round trip.

A model served with pipeline stages, tensor-parallel ranks and hybrid KV cache groups stores each (stage, rank,
group) shard under its own namespace (kvstore_connector/namespace.py), and a prefix is a hit only when every shard can
load its part: every full-attention shard all of it (one prefix probe each, pipelined: Client.probe_prefix_tiers),
every sliding-window or chunked-local shard the window vLLM keeps at the hit (kvstore_connector/groups.py; one more
pipelined probe of those shards' window keys, or of every key up to the hit when a window has a hole). The answer
carries each hit key's tier (the farthest shard's: RAM < DISK < PEER) and, when the hit stops short, which key and
which shards to ask the daemon about (kvstore_connector/misses.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore_connector.groups import first_needed_key, window_hit
from kvstore_connector.link import StoreLink
from kvstore_connector.misses import LOOKUP_FAILED, STORE_DOWN, MissTarget
from kvstore_connector.namespace import StageLayouts
from kvstore_connector.stats import ConnectorCounters
from kvstore.vocab import Tier

if TYPE_CHECKING:
    from kvstore.client import Client

__all__ = ["ShardProbe", "farthest"]


class ShardProbe:
    """``stages``: every shard's layout, in the order of the namespaces each lookup is given."""

    def __init__(self, stages: StageLayouts, link: StoreLink, counters: ConnectorCounters) -> None:
        self.link = link
        self.counters = counters
        self._specs = stages.specs
        self._windowed = [s.group_kind.windowed for s in stages.specs]
        self._tokens_per_key = stages.tokens_per_key
        self._block_size = stages.specs[0].block_size

    def lookup(self, namespaces: list[str], keys: list[bytes]) -> tuple[int, list[int], str | MissTarget | None]:
        """(leading keys every shard holds, the tier each comes from: the farthest over the shards, a Tier value,
        why it stopped there: the first missing key and the shards that may lack it, or a cause known here):
        one prefix probe per shard namespace, pipelined into one round trip on the fast path
        (Client.probe_prefix_tiers; it splits chains longer than the daemon's max_batch_keys, a 64K+ token
        prompt)."""
        if not keys or self.link.client is None:
            return 0, [], STORE_DOWN
        full = [ns for ns, w in zip(namespaces, self._windowed) if not w]
        def probe(c: Client) -> tuple[int, list[int], MissTarget | None]:
            n, tiers = c.probe_prefix_tiers(full, keys) if full else (len(keys), [int(Tier.RAM)] * len(keys))
            hit, tiers, short = self._window_hit(c, namespaces, keys, tiers) if n and len(full) < len(namespaces) else (
                n, tiers, None)
            return hit, tiers, short or (MissTarget(tuple(full), keys[n]) if n < len(keys) else None)
        got = self.link.call(namespaces, probe)
        if got is None:  # store down or the call failed -> no hit
            return 0, [], STORE_DOWN if self.link.client is None else LOOKUP_FAILED
        return got

    def _window_hit(self, c: Client, namespaces: list[str], keys: list[bytes],
                    tiers: list[int]) -> tuple[int, list[int], MissTarget | None]:
        """The hit of at most ``len(tiers)`` keys (the full shards' common prefix and its tiers) every windowed
        shard can serve: its window before that first (the common case, one probe of a window's keys), else
        every key up to it and the longest hit they allow; the tiers of the hit, windowed shards included; when
        a window is short, its first missing key in the first windowed shard that lacks one."""
        n = len(tiers)
        shards = [(ns, s.group_kind) for ns, s in zip(namespaces, self._specs) if s.group_kind.windowed]
        t, bs = self._tokens_per_key, self._block_size
        firsts = [first_needed_key(kind, n, tokens_per_key=t, block_size=bs) for _, kind in shards]
        lo = min(firsts)
        got = c.probe_tiers_many([ns for ns, _ in shards], keys[lo:n])
        if all(x != Tier.NONE for first, shard in zip(firsts, got) for x in shard[first - lo:]):
            return n, farthest(tiers, [(first, shard[first - lo:]) for first, shard in zip(firsts, got)]), None
        short = next(MissTarget((ns,), keys[i]) for (ns, _), first, shard in zip(shards, firsts, got)
                     for i in range(first, n) if shard[i - lo] == Tier.NONE)
        if lo:
            got = c.probe_tiers_many([ns for ns, _ in shards], keys[:n])
        hit = window_hit(n, [(kind, [x != Tier.NONE for x in shard]) for (_, kind), shard in zip(shards, got)],
                         tokens_per_key=t, block_size=bs)
        self.counters.add(lookup_window_short_keys=n - hit)
        needs = [first_needed_key(kind, hit, tokens_per_key=t, block_size=bs) for _, kind in shards]
        return hit, farthest(tiers[:hit], [(first, shard[first:hit]) for first, shard in zip(needs, got)]), short


def farthest(tiers: list[int], windows: list[tuple[int, list[int]]]) -> list[int]:
    """``tiers`` with each windowed shard's window (its first key, its keys' tiers) folded in: per key the farthest
    tier any shard serves it from (RAM < DISK < PEER)."""
    out = list(tiers)
    for first, shard in windows:
        for i, x in enumerate(shard, start=first):
            if i < len(out):
                out[i] = max(out[i], int(x))
    return out
