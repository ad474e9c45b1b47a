"""Misses by cause: the daemon's misses_* counters over one replay, checked against the lookups that missed.

The daemon counts exactly one cause (kvstore/engine/miss_causes.py) for every prefix Lookup that stops short
of its keys: the Lookup's first missing key decides the cause. What the replay counts to compare, the same
event seen from the client (`ReplayResult.short_lookups`):

- per request, the probe (replayer._probe): Lookup(prefix=True, lease=False) on the request's chain, one call
  per `max_batch_keys` chunk, stopping at the first chunk that comes back short. So a request counts 1 when its
  probed prefix is shorter than its chain, else 0; a request with no full block issues no Lookup and counts 0.
- the load (Client.get_many_into) is a Lookup WITHOUT prefix (lease=True), the put is a Reserve, and a
  Prefetch hint probes without prefix: the daemon counts none of them, and neither does the replay.

The causes are read as before/after deltas of Stats counters around the run (the daemon starts fresh, but a
delta does not depend on that). `miss_causes_add_up` is True when the deltas sum to `short_lookups`:
"misses attributed to a cause for 100 % of missed lookups". Note a request whose probe found its whole chain
but whose load or verification then fell short is a replay mismatch (verdict.py), not a counted miss.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.engine.misses import CAUSES, COUNTER_OF

__all__ = ["CAUSES", "miss_deltas", "miss_figures", "miss_mismatch"]


def miss_deltas(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """cause -> misses counted by the daemon between two Stats counter snapshots (every cause, zeros kept)."""
    return {c: int(after.get(COUNTER_OF[c], 0)) - int(before.get(COUNTER_OF[c], 0)) for c in CAUSES}


def miss_figures(by_cause: Mapping[str, int], short_lookups: int) -> dict:
    """The point's figures: misses_by_cause, the short prefix lookups, and whether the two add up."""
    return {"misses_by_cause": dict(by_cause), "prefix_lookups_short": short_lookups,
            "miss_causes_add_up": sum(by_cause.values()) == short_lookups}


def miss_mismatch(p: Mapping) -> str | None:
    """A verdict line when the point's causes do not add up to its short prefix lookups (recomputed from the
    counts, so an edited count fails even where the stored flag says otherwise); None when they do."""
    if "misses_by_cause" not in p:
        return None
    total, short = sum(p["misses_by_cause"].values()), p["prefix_lookups_short"]
    if total == short and p.get("miss_causes_add_up", True):
        return None
    return (f"misses by cause add up to {total}, but {short} prefix lookups stopped short "
            f"({', '.join(f'{c} {n}' for c, n in p['misses_by_cause'].items() if n) or 'no cause counted'})")
