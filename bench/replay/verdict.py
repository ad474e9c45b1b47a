"""Store vs simulator: every difference of one replay point named, and the exit status a difference earns.

The replay is exact by construction (replayer.py's sync points make the daemon deterministic), so ANY
difference is a finding, not noise: one request's hit count, one daemon counter the model predicts, one
request whose disk-served positions differ, one loaded block whose content marks did not verify. A bug in
the daemon, in the simulator, or a missing sync point; the figures of such a run are not the store's. Hit
rates that agree to four decimals can hide differences that cancel out, hence request by request and
counter by counter; under S3-FIFO with a disk tier, also a probe whose promotions the daemon landed for other
keys than the model promoted (landing.py). Also a miss without its cause: the daemon's misses_* counters must
add up to the replay's prefix lookups that stopped short (miss_check.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.replay.miss_check import miss_mismatch
from bench.replay.tiers import fmt_tokens

__all__ = ["EXIT_MISMATCH", "mismatches", "all_mismatches"]

EXIT_MISMATCH = 2


def _label(p: dict) -> str:
    disk = f" + disk {fmt_tokens(p['disk_tokens'])}" if p.get("disk_tokens") else ""
    policy = f" ({p['policy']})" if p.get("policy", "lru") != "lru" else ""
    return f"RAM {fmt_tokens(p['capacity_tokens'])}{disk}{policy}"


def mismatches(p: dict) -> list[str]:
    """What differs between the store and its simulation in one point (run.run_point's dict); [] = exact."""
    where, out = _label(p), []
    if p["mismatched_requests"]:
        first = ", ".join(f"request {i}: store {a} hits, simulated {b}" for i, a, b in p["first_mismatches"])
        out.append(f"{where}: {p['mismatched_requests']} of {p['requests']} requests differ (first: {first})")
    for name in p["tier_mismatches"]:
        store, sim = p["tier_checks"][name]
        out.append(f"{where}: counter {name}: store {store}, simulated {sim}")
    if p.get("mismatched_disk_hits"):
        out.append(f"{where}: {p['mismatched_disk_hits']} requests were served from disk at other positions "
                   "than simulated")
    if p.get("landing_mismatches"):
        out.append(f"{where}: {p['landing_mismatches']} probes' promotions landed (event stream) for other keys "
                   "than the simulator promoted")
    if p["verify_failures"]:
        out.append(f"{where}: {p['verify_failures']} loaded blocks failed their content marks")
    missed = miss_mismatch(p)
    if missed is not None:
        out.append(f"{where}: {missed}")
    return out


def all_mismatches(points: Sequence[dict]) -> list[str]:
    return [m for p in points for m in mismatches(p)]
