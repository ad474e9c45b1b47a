"""bench.cluster's table and plot: hit rate and lookup latency per N, and hit rate over time through churn.

The plot (one PNG per churn run) draws the cluster's hit rate and the one-node reference's over the same
requests, each a rolling mean over churn.WINDOW requests against the run's seconds, with every event as a
vertical line named by its kind and node. matplotlib is imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench._common import print_table
from bench.cluster.churn import WINDOW, Event, EventCost
from bench.cluster.drive import Record

__all__ = ["steady_table", "churn_table", "plot_churn"]


def steady_table(rows: Sequence[dict]) -> None:
    print_table("bench.cluster: N nodes sharing capacity C against one node with C (same requests)",
                ["spread", "N", "hit rate", "vs one node", "lookup p50 ms", "lookup p99 ms", "peer B / served B",
                 "failed", "wrong"],
                [[r["spread"], r["nodes"], f"{r['hit_rate']:.4f}", f"{r['vs_single']:.3f}",
                  f"{r['lookup_p50_ms']:.2f}", f"{r['lookup_p99_ms']:.2f}", f"{r['peer_bytes_per_served']:.3f}",
                  r["failed_calls"], r["wrong_blocks"]] for r in rows])


def churn_table(nodes: int, cs: Sequence[EventCost]) -> None:
    print_table(f"bench.cluster: churn at N = {nodes} (level = cluster hits / one node's over {WINDOW} requests)",
                ["event", "node", "at s", "took s", "failed", "wrong", "level before", "after", "dip",
                 "back after s"],
                [[c.kind, c.node, f"{c.at_s:.1f}", f"{c.took_s:.1f}", c.failed, c.wrong, f"{c.level:.3f}",
                  f"{c.after:.3f}", f"{c.dip:.3f}", "not back" if c.back_s is None else f"{c.back_s:.1f}"]
                 for c in cs])


def _rolling(values: Sequence[int], totals: Sequence[int]) -> list[float]:
    out = []
    for i in range(len(values)):
        lo = max(0, i - WINDOW + 1)
        want = sum(totals[lo:i + 1])
        out.append(sum(values[lo:i + 1]) / want if want else 0.0)
    return out


def plot_churn(path: Path, nodes: int, cl: Sequence[Record], ref_hits: Sequence[int], events: Sequence[Event]) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.t for r in cl]
    blocks = [r.blocks for r in cl]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.plot(t, _rolling([r.hit for r in cl], blocks), label=f"cluster of {nodes} (C split {nodes} ways)", lw=1.4)
    ax.plot(t, _rolling(list(ref_hits), blocks), label="one node with C (same requests)", lw=1.0, alpha=0.7)
    for ev in events:
        ax.axvline(ev.t_start, color="grey", ls="--", lw=0.8)
        ax.text(ev.t_start, 1.01, f"{ev.kind} {ev.node}", rotation=0, fontsize=8, ha="left", va="bottom",
                transform=ax.get_xaxis_transform())
    ax.set_xlabel("seconds into the replay")
    ax.set_ylabel(f"hit rate (blocks, rolling {WINDOW} requests)")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
