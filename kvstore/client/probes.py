"""How much of a key chain every one of several namespaces holds: the scheduler's probe of a model's shards.

A model served with tensor or pipeline parallelism stores each shard (TP rank x pipeline stage) under its own
namespace, and a prefix is only a hit when every shard can load it. Over the fast path the namespaces' prefix
Lookups (no lease, summary) are pipelined: one round trip for all, then the daemon's work for each. Each
namespace is probed over the whole chunk, so one that holds more than the others may start promotions of
disk blocks past the common prefix (bounded by the chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.client.batches import chunks
from kvstore.client.control import ControlPlane
from kvstore.vocab import Tier

__all__ = ["common_prefix", "common_prefix_tiers", "tiers_many"]

_RAM = int(Tier.RAM)


def common_prefix(control: ControlPlane, check_incarnation: Callable[[int], None], max_batch_keys: int,
                  namespaces: Sequence[str], keys: Sequence[bytes]) -> tuple[int, bool]:
    """(leading keys every namespace holds, whether all of those are in RAM in every one)."""
    n, tiers = common_prefix_tiers(control, check_incarnation, max_batch_keys, namespaces, keys)
    return n, tiers.count(_RAM) == len(tiers)  # list.count: one C pass (an IntEnum compare per key costs ~0.1 us)


def common_prefix_tiers(control: ControlPlane, check_incarnation: Callable[[int], None], max_batch_keys: int,
                        namespaces: Sequence[str], keys: Sequence[bytes]) -> tuple[int, list[int]]:
    """(leading keys every namespace holds, the tier each of those comes from: the farthest over the namespaces,
    RAM < DISK < PEER, since a load waits for its slowest shard)."""
    tiers: list[int] = []
    whole = isinstance(keys, list) and len(keys) <= max_batch_keys  # one batch: no copy of the chain
    for part in chunks(len(keys), max_batch_keys):
        leases = control.probe_many(namespaces, keys if whole else list(keys[part]))
        for r in leases:
            check_incarnation(r.incarnation)
        n = min((r.num_prefix for r in leases), default=part.stop - part.start)
        if not leases:
            tiers += [int(Tier.RAM)] * n
        elif len(leases) == 1:
            tiers += leases[0].tiers[:n]
        elif all(r.tiers[:n].count(_RAM) == n for r in leases):  # the common case, one C pass a namespace
            tiers += [_RAM] * n
        else:  # the farthest tier per key (a max over the namespaces per key: ~0.5 us a key at TP 8)
            tiers += map(max, *(r.tiers[:n] for r in leases))
        if n < part.stop - part.start:
            break
    return len(tiers), tiers


def tiers_many(control: ControlPlane, check_incarnation: Callable[[int], None], max_batch_keys: int,
               namespaces: Sequence[str], keys: Sequence[bytes]) -> list[list[int]]:
    """Every key's tier (a kvstore.vocab.Tier value, NONE when absent) in each namespace, no lease taken; disk and
    peer hits start their promotion or fetch, as a prefix probe's do."""
    out: list[list[int]] = [[] for _ in namespaces]
    for part in chunks(len(keys), max_batch_keys):
        leases = control.probe_many(namespaces, list(keys[part]), prefix=False)
        for acc, r in zip(out, leases):
            check_incarnation(r.incarnation)
            n = part.stop - part.start
            acc.extend(list(r.tiers[:n]) + [int(Tier.NONE)] * (n - len(r.tiers)))
    return out
