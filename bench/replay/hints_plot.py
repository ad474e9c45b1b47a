"""The --hints run's one plot: hit rate and prefill reduction per policy at each share of unique KV.

Grouped bars (one group a share, one bar a policy: LRU, S3-FIFO, each + hints, Belady), hit rate on the left
panel and prefill reduction on the right, each bar labelled with its value so the PNG reads without the table.
matplotlib only here, imported when plotting (Agg backend: no display), like report.plot_sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["POLICIES", "plot_hints"]

# (label, hit-rate key, prefill-reduction key) in a point of hints_cli, in bar order
POLICIES = (("LRU", "lru_hit_rate", "lru_prefill_reduction"),
            ("S3-FIFO", "s3fifo_hit_rate", "s3fifo_prefill_reduction"),
            ("LRU + hints", "hint_hit_rate", "hint_prefill_reduction"),
            ("S3-FIFO + hints", "s3fifo_hint_hit_rate", "s3fifo_hint_prefill_reduction"),
            ("Belady", "belady_hit_rate", "belady_prefill_reduction"))


def plot_hints(shares: Sequence[float], points: Sequence[dict], path: Path, title: str) -> Path:
    """Write the PNG to `path` (its folder is created) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / len(POLICIES)
    groups = range(len(shares))
    for ax, col, ylabel, fmt in ((axes[0], 1, "hit rate (tokens)", "{:.3f}"),
                                 (axes[1], 2, "prefill reduction (x)", "{:.2f}x")):
        for j, pol in enumerate(POLICIES):
            values = [p[pol[col]] for p in points]
            xs = [g + (j - (len(POLICIES) - 1) / 2) * width for g in groups]
            bars = ax.bar(xs, values, width, label=pol[0])
            ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=7, padding=2)
        ax.set_xticks(list(groups), [f"{s:.0%} of unique KV" for s in shares])
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(POLICIES), fontsize=9)  # below both panels
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
