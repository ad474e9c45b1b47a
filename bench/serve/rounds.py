"""Rounds: every configuration measured again and again, the order reversed each round, the ratios paired.

Why: on this VM one configuration's TTFT p50 and throughput were measured moving ~2x between runs (vLLM alone's
median round 2.5 s in one process, 4.4 s in another; b 0.084-0.179 s), so a ratio of two configurations run
minutes apart carries that drift. With rounds, each ratio is taken inside a round (the two configurations ran
close together), the order alternates (a b f, then f b a: neither is always first or last), and the figure
reported is the median over crossover pairs of rounds (crossover_ratio), as the no-reuse run does.

Round r sends sessions of the same shapes (prompt lengths, forks, think times: agentx's own seed) with new token
ids, so nothing vLLM or a store kept from an earlier round can hit; the kvstore daemons start fresh for every
configuration anyway, LMCache's server and vLLM's prefix caches do not.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.serve.configs import CONFIGS

__all__ = ["SEED_STEP", "RATIOS", "crossover_ratio", "schedule", "round_seed", "make_room", "median_summary",
           "paired_ratios"]

SEED_STEP = 1000  # round r's token seeds start at seed + r * SEED_STEP (a round uses seed .. seed + 2 + rounds)
RATIOS = ("ttft_p50_speedup", "ttft_p50_speedup_disk", "ttft_p50_speedup_peer", "ttft_p50_speedup_routed",
          "throughput_ratio",
          "ttft_p50_vs_lmcache", "throughput_vs_lmcache", "ttft_p50_vs_limit", "throughput_vs_limit")


def round_seed(seed: int, r: int) -> int:
    return seed + r * SEED_STEP


def schedule(keys: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, configuration) in the order they run: `keys` forward in even rounds, backward in odd ones."""
    return [(r, k) for r in range(rounds) for k in (keys if r % 2 == 0 else keys[::-1])]


def make_room(seq: list[str], i: int, running: set[str], want: list[str], most: int) -> list[str]:
    """Running servers to stop before configuration seq[i] boots `want`, so that at most `most` run: those
    seq[i] does not use, the one needed again latest (or never) first (Belady's choice: a boot costs a minute)."""
    need = set(CONFIGS[seq[i]].servers)

    def next_use(s: str) -> int:
        return next((j for j in range(i + 1, len(seq)) if s in CONFIGS[seq[j]].servers), len(seq))
    idle = sorted((s for s in running if s not in need), key=lambda s: (-next_use(s), s))  # ties: by name
    out: list[str] = []
    while idle and len(running | set(want)) - len(out) > most:
        out.append(idle.pop(0))
    return out


def median_summary(per_round: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's summaries (report.summarize), one per round, as one: each figure the median over the
    rounds (a count too: medians of equal counts are the count), the label from the first."""
    if len(per_round) == 1:
        return per_round[0]
    out: dict[str, Any] = {}
    for f, v in per_round[0].items():
        vals = [s.get(f) for s in per_round]
        if isinstance(v, dict):
            keys = sorted({k for x in vals if isinstance(x, dict) for k in x})
            out[f] = {k: statistics.median([x.get(k, 0) for x in vals if isinstance(x, dict)]) for k in keys}
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and all(isinstance(x, (int, float)) for x in vals):
            out[f] = statistics.median(vals)  # type: ignore[type-var]  # checked numeric just above
        else:
            out[f] = v
    return out


def paired_ratios(per_round: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each ratio of RATIOS as each round's JSON line (report.json_line) gave it, in round order; a ratio some
    round could not form (a configuration left out) is left out."""
    return {name: [line[name] for line in per_round] for name in RATIOS
            if all(line.get(name) is not None for line in per_round)}


def crossover_ratio(ratios: list[float]) -> float:
    """with / without from rounds run A, B then B, A (a crossover): the median over each A-B / B-A pair of rounds
    of their geometric mean. Why pairs: the second run of a round was measured slower whichever server it was
    (ratios 0.65 A first, 1.92 B first in one run; 15-20 % either way in others), and a pair holds each server
    once in each position, so that cancels. An odd last round counts alone."""
    pairs = [math.sqrt(ratios[i] * ratios[i + 1]) for i in range(0, len(ratios) - 1, 2)]
    if len(ratios) % 2:
        pairs.append(ratios[-1])
    return round(statistics.median(pairs), 4)
