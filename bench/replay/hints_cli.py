"""`python -m bench.replay --agentx --hints`: what agent hints buy, read against plain LRU and Belady.

At each --hint-shares share of the trace's unique KV (default 10 % and 25 %; RAM taking --ram-share of it, the
rest a disk tier; --ram-share 1 sizes RAM alone) the AgentX trace with its hints (agentx.py) is replayed
through the real store, which receives them through Client.hint, and checked against the exact model
(hints.py): request by request, counter by counter, every hint outcome count; any difference exits 2.
Next to it, at the same store: plain LRU (the exact simulator without hints: the store's policy, equal to
the store by the replay without hints); S3-FIFO, the real store again with policy s3fifo, without hints and
with them, each checked against its own exact simulator (sim_policy.py, which drives the daemon's own policy
and hint classes; with a disk tier following the promotion order the daemon recorded, landing.py), any
difference exiting 2 as well; and Belady's offline optimum over RAM + disk as one pool (belady.py).

stdout: one table (hit rate and prefill reduction per share and policy), the plot's path (hints_plot.py: one
PNG in --out), then one JSON line: the first share's hint_hit_rate, lru_hit_rate, s3fifo_hit_rate,
s3fifo_hint_hit_rate, belady_hit_rate (and each one's prefill reduction), hint_gain (LRU + hints over LRU
prefill reduction), hint_share_of_belady (LRU + hints over Belady hit rate), s3fifo_hint_gain and
s3fifo_hint_share_of_belady (the same for S3-FIFO + hints), every share's point under "points", the plot's
path, and the issue's targets (gain >= 1.3 and share of Belady >= 0.9 at the first share) as booleans.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from bench._common import print_table, progress
from bench.replay.hints_plot import plot_hints
from bench.replay.report import misses_text
from bench.replay.run import Workload, run_point
from bench.replay.tiers import StoreSpec, fmt_tokens
from bench.replay.trace import BLOCK_TOKENS
from bench.replay.verdict import EXIT_MISMATCH, all_mismatches

__all__ = ["hint_specs", "run_hints", "GAIN_TARGET", "SHARE_TARGET"]

GAIN_TARGET = 1.3
SHARE_TARGET = 0.9
HEADLINE = ("hint_hit_rate", "lru_hit_rate", "belady_hit_rate", "hint_gain", "hint_share_of_belady",
            "hint_prefill_reduction", "lru_prefill_reduction", "belady_prefill_reduction", "s3fifo_hit_rate",
            "s3fifo_prefill_reduction", "s3fifo_hint_hit_rate", "s3fifo_hint_prefill_reduction", "s3fifo_hint_gain",
            "s3fifo_hint_share_of_belady")
# from the S3-FIFO runs of a share (without hints, then with), into its point with an s3fifo_ (s3fifo_hint_)
# prefix: their figures and their exactness; and the hinted run's gain and share under their own names
S3FIFO_KEYS = ("hit_rate", "prefill_reduction", "sim_hit_rate", "mismatched_requests", "tier_mismatches",
               "landing_mismatches", "replay_s")
S3FIFO_HINT_KEYS = ("hint_gain", "hint_share_of_belady")


def hint_specs(w: Workload, shares: list[float], ram_share: float, bytes_per_token: int,
               reinsert_hits: int, **writes: str) -> list[StoreSpec]:
    """One store per share of unique KV; ValueError (before any daemon starts) for a disk too small."""
    unique = w.max_result().resident[0] * BLOCK_TOKENS
    out = []
    for share in shares:
        if not 0 < share:
            raise ValueError(f"--hint-shares {share}: use shares > 0 of the unique KV, e.g. 0.1,0.25")
        total = int(share * unique)
        ram = int(total * ram_share)
        try:
            out.append(StoreSpec.ram_disk(ram, total - ram, bytes_per_token, reinsert_hits, **writes))
        except ValueError as exc:
            raise ValueError(f"{share:g} of {fmt_tokens(unique)} unique KV tokens: {exc}; use more --sessions, "
                             "or --ram-share 1 (RAM alone)") from None
    return out


def _rows(shares: list[float], points: list[dict]) -> list[tuple]:
    rows: list[tuple] = []
    for share, p in zip(shares, points):
        disk = f" + disk {fmt_tokens(p['disk_tokens'])}" if p["disk_tokens"] else ""
        where = f"{share:.0%}: RAM {fmt_tokens(p['capacity_tokens'])}{disk}"
        for name, hr, pr in (("LRU (exact simulator)", p["lru_hit_rate"], p["lru_prefill_reduction"]),
                             ("S3-FIFO (store)", p["s3fifo_hit_rate"], p["s3fifo_prefill_reduction"]),
                             ("LRU + hints (store)", p["hint_hit_rate"], p["hint_prefill_reduction"]),
                             ("S3-FIFO + hints (store)", p["s3fifo_hint_hit_rate"],
                              p["s3fifo_hint_prefill_reduction"]),
                             ("Belady (one pool)", p["belady_hit_rate"], p["belady_prefill_reduction"])):
            rows.append((where, name, f"{hr:.4f}", f"{pr:.2f}x", f"{hr / p['belady_hit_rate']:.3f}"
                         if p["belady_hit_rate"] else "-"))
        rows.append((where, "hint gain over LRU (prefill reduction)", "", f"{p['hint_gain']:.3f}x", ""))
        rows.append((where, "S3-FIFO + hints over LRU", "", f"{p['s3fifo_hint_gain']:.3f}x", ""))
    return rows


def run_hints(a: argparse.Namespace, w: Workload, parser: argparse.ArgumentParser) -> int:
    t0 = time.perf_counter()
    shares = a.hint_shares
    try:
        specs = hint_specs(w, shares, a.ram_share, a.bytes_per_token, a.disk_reinsert_hits,
                           disk_write=a.disk_write, disk_admission=a.disk_admission)
    except ValueError as exc:
        parser.error(str(exc))
    points, fifo = [], []
    with progress(3 * len(w.requests) * len(specs)) as bar:
        for share, spec in zip(shares, specs):
            bar.step(f"hints at {share:.0%}: RAM {fmt_tokens(spec.ram_tokens)}")
            p = run_point(w, spec, bar.advance, hints=True)
            bar.step(f"S3-FIFO at {share:.0%}")
            fifo.append(run_point(w, spec.with_policy("s3fifo"), bar.advance))
            bar.step(f"S3-FIFO + hints at {share:.0%}")
            fifo.append(run_point(w, spec.with_policy("s3fifo"), bar.advance, hints=True))
            points.append(p | {f"s3fifo_{k}": fifo[-2][k] for k in S3FIFO_KEYS}
                          | {f"s3fifo_hint_{k}": fifo[-1][k] for k in S3FIFO_KEYS}
                          | {f"s3fifo_{k}": fifo[-1][k] for k in S3FIFO_HINT_KEYS})
    print_table(f"Agent hints: {w.name}" + (f" ({w.cut})" if w.cut else ""),
                ["store (share of unique KV)", "policy", "hit rate", "prefill reduction", "of Belady"],
                _rows(shares, points))
    head = points[0]
    for share, p in zip(shares, points):
        print(f"{share:.0%}: {misses_text(p)}")
    stem = re.sub(r"[^A-Za-z0-9]+", "_", w.name).strip("_") + ("_quick" if a.quick else "_cut" if w.cut else "")
    png = plot_hints(shares, points, a.out / f"hints_{stem}.png",
                     f"{w.name}{' (quick)' if a.quick else ''}: LRU, S3-FIFO, with and without hints, Belady")
    print(f"plot: {png}")
    bad = all_mismatches(points) + all_mismatches(fifo)
    keep = tuple(dict.fromkeys(HEADLINE + tuple(f"s3fifo_{k}" for k in S3FIFO_KEYS)
                               + tuple(f"s3fifo_hint_{k}" for k in S3FIFO_KEYS) + (
        "capacity_tokens", "disk_tokens", "store_share_of_unique", "hit_rate", "sim_hit_rate", "mismatched_requests",
        "tier_mismatches", "tier_checks", "conditions", "replay_s", "hint_s", "misses_by_cause", "prefix_lookups_short",
        "miss_causes_add_up", "disk_written_bytes", "disk_written_per_served")))
    result = {"trace": w.name, "cut": w.cut, "requests": len(w.requests), "share": shares[0],
              **{k: head[k] for k in HEADLINE},
              **{k: head[k] for k in ("misses_by_cause", "prefix_lookups_short", "miss_causes_add_up")},
              "targets": {"hint_gain": GAIN_TARGET, "hint_share_of_belady": SHARE_TARGET,
                          "hint_gain_met": head["hint_gain"] >= GAIN_TARGET,
                          "hint_share_of_belady_met": head["hint_share_of_belady"] >= SHARE_TARGET,
                          "s3fifo_hint_gain_met": head["s3fifo_hint_gain"] >= GAIN_TARGET,
                          "s3fifo_hint_share_of_belady_met": head["s3fifo_hint_share_of_belady"] >= SHARE_TARGET},
              "points": [{"share": s, **{k: p[k] for k in keep}} for s, p in zip(shares, points)],
              "plot": str(png), "exact": not bad, "mismatches": bad[:20],
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    if bad:
        print(f"MISMATCH: the store differs from its exact simulation in {len(bad)} ways; first:", file=sys.stderr)
        for line in bad[:10]:
            print(f"  {line}", file=sys.stderr)
    print(json.dumps(result, separators=(",", ":")))
    return EXIT_MISMATCH if bad else 0
