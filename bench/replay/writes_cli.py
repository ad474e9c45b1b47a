"""`python -m bench.replay --writes`: what each way of writing the disk tier costs the SSD and buys in hits.

At one store (--unique-share of the trace's unique KV, default 10 %, RAM taking --ram-share of it, the rest a
disk tier; or --capacity-tokens / --disk-tokens) every combination of disk_write (commit, evict) and
disk_admission (always, seen:2) runs through the real store and its exact simulator (any difference exits 2,
as every replay), and each mode under a write budget through the simulator only: budgets of 1/2, 1/4 and 1/10
of what that mode writes with no budget, averaged over the trace (bytes per second of the trace's clock, a 60 s
window; the daemon's budget runs on its own clock, which a replay outruns, so no daemon can be given the same
budget). --sim-only runs every point through the simulator (the full-scale trace: minutes, not hours).

Per point: hit rate, prefill reduction, disk bytes written (device bytes, second-chance copies included), bytes
written per byte served to readers (`disk_written_per_served`: what each hit costs the flash), and Belady's
hit rate at the same capacity. The verdict (the issue's target): against commit + always (today's default),
some other point reaches at least its hit rate with at most half its bytes written, or a higher hit rate
with no more bytes written (`targets`). stdout: the table, the plot's path (hit rate against bytes written,
one line a mode through its budgets), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from bench._common import print_table, progress
from bench.replay.belady import belady
from bench.replay.metrics import hit_figures
from bench.replay.run import Workload, run_point
from bench.replay.sim import simulate
from bench.replay.tiers import StoreSpec, fmt_tokens
from bench.replay.trace import BLOCK_TOKENS
from bench.replay.verdict import EXIT_MISMATCH, all_mismatches

__all__ = ["run_writes", "write_specs", "BUDGET_SHARES", "verdict"]

MODES = (("commit", "always"), ("commit", "seen:2"), ("evict", "always"), ("evict", "seen:2"))
BUDGET_SHARES = (0.5, 0.25, 0.1)
WINDOW_S = 60.0


def write_specs(a: argparse.Namespace, w: Workload) -> list[StoreSpec]:
    """The four modes at the run's store; ValueError (before any daemon starts) for a size that cannot be."""
    if a.capacity_tokens is not None or a.disk_tokens is not None:
        ram, disk = a.capacity_tokens or 0, a.disk_tokens or 0
    else:
        share = a.unique_share if a.unique_share is not None else 0.1
        total = int(share * w.max_result().resident[0] * BLOCK_TOKENS)
        ram = int(total * a.ram_share)
        disk = total - ram
    if not disk:
        raise ValueError("--writes compares ways of writing a disk tier: give it one (--disk-tokens or a share)")
    return [StoreSpec.ram_disk(ram, disk, a.bytes_per_token, a.disk_reinsert_hits, a.policy, disk_write=m,
                               disk_admission=adm) for m, adm in MODES]


def _sim_point(w: Workload, spec: StoreSpec) -> dict:
    """The figures of one store from the exact simulator alone (the budget points)."""
    reqs, conv = w.requests, w.convention
    sim = simulate(reqs, spec.sim_tiers(), conv, plan=spec.write_plan)
    f = hit_figures(reqs, sim.hits, conv)
    served = sum(sim.hits) * spec.block_bytes
    written = sim.counters.get("disk_bytes_written", 0)
    return {"hit_rate": round(f.hit_rate, 5), "prefill_reduction": round(f.prefill_reduction, 4),
            "disk_written_bytes": written, "disk_written_per_served": round(written / served, 4) if served else 0.0,
            "disk_writes": sim.counters.get("disk_writes", 0), "sim_only": True}


def _label(spec: StoreSpec) -> str:
    budget = f", budget {spec.disk_write_budget / 1e6:.3g} MB/s" if spec.disk_write_budget else ""
    return f"{spec.disk_write} / {spec.disk_admission}{budget}"


def verdict(points: list[dict]) -> dict:
    """The issue's target against commit + always (the first point): the best point at <= half its bytes with at
    least its hit rate, and the best hit rate at <= its bytes."""
    base = points[0]
    h0, b0 = base["hit_rate"], base["disk_written_bytes"]
    half = [p for p in points[1:] if p["disk_written_bytes"] <= b0 / 2 and p["hit_rate"] >= h0]
    same = [p for p in points[1:] if p["disk_written_bytes"] <= b0 and p["hit_rate"] > h0]
    best_half = max(half, key=lambda p: p["hit_rate"], default=None)
    best_same = max(same, key=lambda p: p["hit_rate"], default=None)
    return {"commit_hit_rate": h0, "commit_written_bytes": b0,
            "half_bytes_same_hits": best_half["label"] if best_half else None,
            "more_hits_same_bytes": best_same["label"] if best_same else None,
            "met": bool(best_half or best_same)}


def run_writes(a: argparse.Namespace, w: Workload, parser: argparse.ArgumentParser) -> int:
    t0 = time.perf_counter()
    try:
        specs = write_specs(a, w)
    except ValueError as exc:
        parser.error(str(exc))
    duration = max(1.0, (w.requests[-1].timestamp_ms - w.requests[0].timestamp_ms) / 1000.0)
    pool = specs[0].tiers[0].capacity_blocks + (specs[0].disk.capacity_blocks if specs[0].disk else 0)
    bel = hit_figures(w.requests, belady(w.ceiling_plan(), pool).hits, w.convention)
    points: list[dict] = []
    exact: list[dict] = []
    with progress(len(w.requests) * len(specs)) as bar:
        for spec in specs:
            bar.step(f"{_label(spec)}")
            if a.sim_only:
                p = _sim_point(w, spec)
                for _ in w.requests:
                    bar.advance()
            else:
                p = run_point(w, spec, bar.advance)
                exact.append(p)
            points.append({"label": _label(spec), "disk_write": spec.disk_write, "admission": spec.disk_admission,
                           "budget_bytes_per_s": 0, **{k: p[k] for k in (
                               "hit_rate", "prefill_reduction", "disk_written_bytes", "disk_written_per_served")}})
    for spec, base in zip(specs, list(points)):
        if spec.disk_admission != "always":
            continue
        rate = base["disk_written_bytes"] / duration
        for share in BUDGET_SHARES:
            budgeted = StoreSpec.ram_disk(spec.ram_tokens, spec.disk_tokens, spec.bytes_per_token,
                                          spec.disk_reinsert_hits, spec.policy, disk_write=spec.disk_write,
                                          disk_write_budget=max(1, int(rate * share)),
                                          disk_write_budget_window_s=WINDOW_S)
            p = _sim_point(w, budgeted)
            points.append({"label": _label(budgeted), "disk_write": spec.disk_write, "admission": "always",
                           "budget_bytes_per_s": budgeted.disk_write_budget, "budget_share": share,
                           **{k: p[k] for k in ("hit_rate", "prefill_reduction", "disk_written_bytes",
                                                "disk_written_per_served")}})
    rows = [(p["label"], f"{p['hit_rate']:.4f}", f"{p['prefill_reduction']:.2f}x",
             f"{p['disk_written_bytes'] / 1e9:.3f}", f"{p['disk_written_per_served']:.3f}",
             "store = sim" if p["budget_bytes_per_s"] == 0 and not a.sim_only else "simulated") for p in points]
    head = specs[0]
    where = f"RAM {fmt_tokens(head.ram_tokens)} + disk {fmt_tokens(head.disk_tokens)}"
    print_table(f"Disk writes: {w.name}" + (f" ({w.cut})" if w.cut else "") + f", {where}, {head.policy}; "
                f"Belady {bel.hit_rate:.4f}", ["disk_write / admission", "hit rate", "prefill reduction",
                                               "disk GB written", "written / served", "source"], rows)
    stem = re.sub(r"[^A-Za-z0-9]+", "_", w.name).strip("_") + ("_quick" if a.quick else "_cut" if w.cut else "")
    png = plot_writes(points, a.out / f"writes_{stem}.png", f"{w.name}: hit rate vs disk bytes written ({where})")
    print(f"plot: {png}")
    bad = all_mismatches(exact)
    result = {"trace": w.name, "cut": w.cut, "requests": len(w.requests), "store": where, "policy": head.policy,
              "ram_tokens": head.ram_tokens, "disk_tokens": head.disk_tokens, "trace_duration_s": round(duration, 1),
              "belady_hit_rate": round(bel.hit_rate, 5), "points": points, "targets": verdict(points),
              "plot": str(png), "sim_only": a.sim_only, "exact": not bad, "mismatches": bad[:20],
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    if bad:
        print(f"MISMATCH: the store differs from its exact simulation in {len(bad)} ways; first:", file=sys.stderr)
        for line in bad[:10]:
            print(f"  {line}", file=sys.stderr)
    print(json.dumps(result, separators=(",", ":")))
    return EXIT_MISMATCH if bad else 0


def plot_writes(points: list[dict], path: Path, title: str) -> Path:
    """Hit rate against disk bytes written, one line a (mode, admission) through its budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[dict]] = {}
    for p in points:
        series.setdefault(f"{p['disk_write']} / {p['admission']}", []).append(p)
    for name, ps in series.items():
        ps = sorted(ps, key=lambda p: p["disk_written_bytes"])
        ax.plot([p["disk_written_bytes"] / 1e9 for p in ps], [p["hit_rate"] for p in ps], marker="o", label=name)
        for p in ps:
            if p["budget_bytes_per_s"]:
                ax.annotate(f"{p['budget_share']:g}x", (p["disk_written_bytes"] / 1e9, p["hit_rate"]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("disk bytes written (GB; labels: budget as a share of the mode's unbudgeted rate)")
    ax.set_ylabel("hit rate (tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
