"""The sweep's outputs: a markdown table and a PNG of hit rate vs capacity, one line per store shape.

A point is the flat figures dict of one run (the same dict the CLI prints as JSON). Points are grouped into
series by their `store` label ('RAM', 'RAM+disk'), so adding a tier adds a line without touching this file.
The x axis is the store's total capacity, RAM + disk tokens: the RAM-only line and the RAM+disk line (a fixed
RAM size plus growing disks; its first point, disk 0, is RAM alone) then answer "what does a token of
capacity buy" in either tier. Points without a disk tier read as disk 0. matplotlib is imported only here
and only when plotting (Agg backend: no display), so the replay itself needs nothing beyond the project's
dependencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.replay.tiers import fmt_tokens

__all__ = ["Series", "misses_text", "series_from_points", "markdown_table", "plot_sweep", "summary_rows", "summary_title",
           "conditions_text", "lock_step_text"]


def _total(p: dict) -> int:
    return p["capacity_tokens"] + p.get("disk_tokens", 0)


_COLUMNS = (
    ("capacity", lambda p: fmt_tokens(_total(p))),
    ("store", lambda p: p["store"]),
    ("RAM", lambda p: f"{fmt_tokens(p['capacity_tokens'])} ({p['arena_bytes'] / 2**20:.0f} MiB)"),
    ("disk", lambda p: f"{fmt_tokens(p['disk_tokens'])} ({p['disk_bytes'] / 2**20:.0f} MiB)"
     if p.get("disk_tokens") else "-"),
    ("hit rate", lambda p: f"{p['hit_rate']:.4f}"),
    ("sim hit rate", lambda p: f"{p['sim_hit_rate']:.4f}"),
    ("RAM / disk hit rate",
     lambda p: f"{p.get('hit_rate_ram', p['hit_rate']):.4f} / {p.get('hit_rate_disk', 0.0):.4f}"),
    ("of max", lambda p: f"{p['hit_rate'] / p['max_hit_rate']:.1%}" if p["max_hit_rate"] else "-"),
    ("prefill reduction", lambda p: f"{p['prefill_reduction']:.3f}x"),
    ("disk write amp.", lambda p: f"{p['disk_write_amplification']:.2f}x" if p.get("disk_tokens") else "-"),
    ("loads GB/s", lambda p: f"{p['load_gbps']:.2f}"),
    ("puts GB/s", lambda p: f"{p['put_gbps']:.2f}"),
    ("req/s", lambda p: f"{p['requests_per_s']:.0f}"),
    ("lock-step", lambda p: lock_step_text(p["conditions"])),
    ("belady hit rate (one pool)", lambda p: f"{p['belady_hit_rate']:.4f}" if "belady_hit_rate" in p else "-"),
)


def lock_step_text(c: dict) -> str:
    """Where the replay waited for the daemon: 'leases' (between a load and its put, until no lease is held),
    'disk writes' (after each request, until the writer drained), 'promotions' (before a get)."""
    return ", ".join(c["lock_step"]) or "none"


def conditions_text(c: dict) -> str:
    """One line: what the daemon ran under and where the replay waited for it (run._conditions)."""
    parts = [f"{c['policy']}, watermarks high {c['high_watermark']:g} / low {c['low_watermark']:g}"
             + (" (only allocation pressure evicts, one block at a time)" if c["high_watermark"] >= 1 else "")]
    if "disk_sync" in c:
        parts.append(f"disk_sync {c['disk_sync']}, admission {c['disk_admission']}, codec {c['disk_codec']}, "
                     f"reinsert hits {c['disk_reinsert_hits']}, {c['disk_segments']} segments of "
                     f"{c['disk_segment_bytes'] / 2**20:.0f} MiB")
    parts.append(f"lock-step: {lock_step_text(c)}")
    return "; ".join(parts)


@dataclass(frozen=True)
class Series:
    label: str
    capacity_tokens: tuple[int, ...]
    hit_rate: tuple[float, ...]
    sim_hit_rate: tuple[float, ...]
    belady_hit_rate: tuple[float, ...] = ()  # the offline optimum at each point's capacity (bench/replay/belady.py)


def _series_label(p: dict) -> str:
    """'RAM' for the RAM-only line; 'RAM 3M + disk' for a RAM size with growing disks."""
    return "RAM" if p["store"] == "RAM" else f"RAM {fmt_tokens(p['capacity_tokens'])} + {p['store'][4:]}"


def series_from_points(points: Sequence[dict]) -> list[Series]:
    by_label: dict[str, list[dict]] = {}
    for p in points:
        by_label.setdefault(_series_label(p), []).append(p)
    ram_only = {q["capacity_tokens"]: q for q in by_label.get("RAM", ())}
    out = []
    for label, pts in sorted(by_label.items(), key=lambda kv: (kv[0] != "RAM", kv[0])):  # RAM's line first
        pts = sorted(pts, key=_total)
        if label != "RAM" and pts[0]["capacity_tokens"] in ram_only:  # the line starts at disk 0 (RAM alone)
            pts = [ram_only[pts[0]["capacity_tokens"]], *pts]
        belady = tuple(p["belady_hit_rate"] for p in pts) if all("belady_hit_rate" in p for p in pts) else ()
        out.append(Series(label, tuple(_total(p) for p in pts), tuple(p["hit_rate"] for p in pts),
                          tuple(p["sim_hit_rate"] for p in pts), belady))
    return out


def summary_title(p: dict) -> str:
    cut = f"; {p['cut']}" if p["cut"] else ""
    disk = f" + disk {fmt_tokens(p['disk_tokens'])}" if p.get("disk_tokens") else ""
    return (f"{p['trace']} ({p['requests']} requests{cut}): RAM {fmt_tokens(p['capacity_tokens'])}{disk} "
            f"tokens, {p['bytes_per_token']} B/token")


def misses_text(p: dict) -> str:
    """The daemon's misses by cause (non-zero causes), against the replay's short prefix lookups."""
    by = p.get("misses_by_cause", {})
    causes = ", ".join(f"{c} {n:,}" for c, n in by.items() if n) or "none"
    verdict = "add up" if p.get("miss_causes_add_up") else "DO NOT ADD UP"
    return f"{causes} = {sum(by.values()):,} / {p.get('prefix_lookups_short', 0):,} ({verdict})"


def _triple(p: dict, fmt: str, *keys: str) -> str:
    return " / ".join(format(p[k], fmt) for k in keys)


def summary_rows(p: dict) -> list[tuple[str, str]]:
    """The headline figures of one point, for people (the JSON line has them all)."""
    rows = [
        ("hit rate (tokens): store / simulated / infinite",
         _triple(p, ".4f", "hit_rate", "sim_hit_rate", "max_hit_rate")),
        ("store hit rate as a share of the maximum", f"{p['hit_rate_of_max']:.1%}"),
    ]
    if "belady_hit_rate" in p:
        rows += [
            (f"belady: hit rate / prefill reduction (offline optimum, RAM + disk as one pool of "
             f"{p['belady_blocks']:,} blocks)", f"{p['belady_hit_rate']:.4f} / {p['belady_prefill_reduction']:.3f}x"),
            ("simulated LRU store: prefill reduction; share of belady's hit rate (one-pool LRU's hit rate)",
             f"{p['lru_prefill_reduction']:.3f}x; {p['lru_share_of_belady']:.1%} ({p['lru_pool_hit_rate']:.4f})"),
        ]
    rows += [
        ("requests where store and simulator differ", str(p["mismatched_requests"])),
        ("counters where store and simulator differ", ", ".join(p.get("tier_mismatches", ())) or "none"),
        ("misses by cause (daemon) / prefix lookups that stopped short", misses_text(p)),
        ("conditions", conditions_text(p["conditions"])),
        ("prefill tokens: no cache -> store (reduction)",
         f"{p['prefill_tokens_no_cache']:,} -> {p['prefill_tokens']:,} ({p['prefill_reduction']:.3f}x)"),
        ("bytes loaded from RAM / stored", f"{p['loaded_bytes'] / 1e9:.2f} GB / {p['stored_bytes'] / 1e9:.2f} GB"),
        ("loads / puts GB/s (memcpy ceiling)",
         f"{_triple(p, '.2f', 'load_gbps', 'put_gbps')} ({p['memcpy_gbps']:.1f})"),
        ("requests/s through the store", str(p["requests_per_s"])),
        ("GPU-s per task: store / no cache / infinite",
         _triple(p, ".2f", "gpu_s_per_task_mean", "gpu_s_per_task_mean_no_cache", "gpu_s_per_task_mean_max")),
    ]
    if p.get("disk_tokens"):
        rows[1:1] = [
            ("hit rate by tier: RAM / disk (simulated)",
             f"{p['hit_rate_ram']:.4f} / {p['hit_rate_disk']:.4f} ({p['sim_hit_rate_ram']:.4f} / "
             f"{p['sim_hit_rate_disk']:.4f})"),
            ("disk: segments x size (blocks held)",
             f"{p['disk_segments']} x {p['disk_segment_bytes'] / 2**20:.0f} MiB ({p['disk_blocks']:,} blocks)"),
            ("disk bytes promoted / written; blocks reclaimed",
             f"{p['promoted_bytes'] / 1e9:.2f} GB / {p['disk_written_bytes'] / 1e9:.2f} GB; "
             f"{p['disk_reclaimed_blocks']:,}"),
            ("disk second chance (reads to keep): blocks kept; write amplification",
             f"{p['disk_reinsert_hits'] or 'off'}: {p['disk_reinserted_blocks']:,}; "
             f"{p['disk_write_amplification']:.3f}x"),
            ("disk_write / admission: disk bytes written per byte served",
             f"{p['disk_write']} / {p['disk_admission']}: {p['disk_written_per_served']:.3f}"),
            ("waiting for the disk writer and promotions", f"{p['settle_s']:.1f} s ({p['settle_polls']:,} polls)"),
        ]
    if "ttna_p50_s" in p:
        for suffix, what in (("", "store"), ("_no_cache", "no cache")):
            keys = (f"ttna_p50_s{suffix}", f"ttna_p90_s{suffix}", f"ttna_p99_s{suffix}")
            rows.append((f"time to next action p50/p90/p99 s ({what})", _triple(p, ".2f", *keys)))
    return rows


def markdown_table(points: Sequence[dict], title: str) -> str:
    head = [c for c, _ in _COLUMNS]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in sorted(points, key=lambda p: (p["store"], _total(p))):
        lines.append("| " + " | ".join(f(p) for _, f in _COLUMNS) + " |")
    if points:
        p = points[0]
        c = next((q["conditions"] for q in points if "disk_sync" in q["conditions"]), p["conditions"])
        disk = (f"disk_sync {c['disk_sync']} (a hit-rate replay), admission {c['disk_admission']}, codec "
                f"{c['disk_codec']}, reinsert hits {c['disk_reinsert_hits']}. " if "disk_sync" in c else "")
        lines += ["", f"Infinite-cache maximum hit rate: {p['max_hit_rate']:.4f}. Token-level rates over all "
                  f"input tokens; {p['bytes_per_token']} KV bytes a token "
                  f"({p['block_bytes'] // 1024} KiB a 512-token block). Capacity = RAM + disk tokens; the disk "
                  f"is rounded down to whole segments (its MiB column). Conditions: {c['policy']}, watermarks "
                  f"high {c['high_watermark']:g} / low {c['low_watermark']:g} (only allocation pressure evicts); "
                  f"{disk}Lock-step: the replay waits for the daemon where that column says (leases: between a "
                  "load and its put until no lease is held; disk writes: after each request until the writer "
                  "drained; promotions: before a get until the probe's promotions landed)."]
    return "\n".join(lines) + "\n"


def plot_sweep(series: Sequence[Series], max_hit_rate: float, path: Path, title: str) -> Path:
    """Hit rate (measured: markers; simulated: dashed) vs total capacity in tokens, log x, with the maximum and,
    where the points carry it, Belady's offline optimum (one line: it depends on the total capacity only)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for s in series:
        line = ax.plot(s.capacity_tokens, s.hit_rate, marker="o", label=f"{s.label} (store)")[0]
        ax.plot(s.capacity_tokens, s.sim_hit_rate, linestyle="--", color=line.get_color(), alpha=0.6,
                label=f"{s.label} (simulated)")
    ceiling = sorted({c: b for s in series for c, b in zip(s.capacity_tokens, s.belady_hit_rate)}.items())
    if ceiling:
        ax.plot([c for c, _ in ceiling], [b for _, b in ceiling], color="black", linestyle="-.", linewidth=1,
                label="Belady (offline optimum)")
    ax.axhline(max_hit_rate, color="grey", linestyle=":", label=f"infinite cache ({max_hit_rate:.3f})")
    ax.axhline(max_hit_rate / 2, color="grey", linestyle=(0, (1, 4)), linewidth=0.8, label="half of the maximum")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: fmt_tokens(int(x))))
    ax.set_xlabel("capacity: RAM + disk (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, max(max_hit_rate * 1.1, 0.05))
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
