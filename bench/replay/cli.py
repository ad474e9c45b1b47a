"""`python -m bench.replay`: replay a trace (or an AgentX-shaped one) through the real store and the simulator.

stdout: a short human summary (and the sweep's markdown table), then, as its LAST line, exactly one JSON object
with every figure (see run.py for the names), its "conditions" (watermarks, disk_sync, where the replay ran
in lock-step with the daemon) and "exact". stderr: the progress bar and notes. Exit status 2 when the real
store differs from its exact simulation anywhere, in any replayed point: one request's hits, one counter,
one disk-served position, one block that failed its marks (verdict.py; each difference is named on stderr
and in the JSON's "mismatches"). The replay is exact by construction, so a difference is a finding, not noise.

--disk-tokens N adds the daemon's disk tier (see tiers.py for its segments; disk_sync none: a hit-rate
replay), with its second chance at reclamation (--disk-reinsert-hits, the daemon's default 1; 0: plain
FIFO). A run with a disk tier also replays RAM alone at the same RAM size ("ram_only" in the JSON), so one
run shows what the disk adds. --unique-share F sizes RAM + disk to F x the trace's unique KV tokens (every
distinct cacheable block once), RAM taking --ram-share of it.

--quick cuts (and says so in the JSON's "cut"): a trace file to its first 15 minutes (~2,700 of the
conversation trace's 12,031 requests), AgentX to 20 sessions at scale 0.25 (40 with --hints, so that a disk
of 5 % of unique KV has the segments the daemon needs), a sweep to fewer capacities;
its headline is RAM 3M + disk 30M tokens (next to RAM 3M alone).
AgentX's default capacities (3M tokens, and the sweep's) are multiplied by its --scale, since every token
count of the trace is; its sweep spans 100K..5M tokens, where its working set lies.

--disk-write (evict | commit, the daemon's default evict) and --disk-admission (always | seen:N | never) set
when and which blocks the disk tier takes, on the daemon and in the simulator alike; --policy the RAM tier's.

--hints (AgentX only; hints_cli.py): the trace with its agent hints at 10 % and 25 % of unique KV
(--hint-shares), the real store sent the hints, against plain LRU and Belady, one table and one JSON line.
--writes (writes_cli.py): every disk_write x admission through the real store, and write budgets through the
simulator, at one store: hit rate against disk bytes written, a table, a plot and one JSON line.
--sweep draws two lines on one PNG: RAM alone at each --capacities size, and RAM + disk (RAM fixed, disks of
--disk-capacities; its first point is RAM alone), against the total capacity RAM + disk.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from bench._common import print_table, progress
from bench.replay.agentx import AgentXParams, generate
from bench.replay.agentx_stats import TARGETS, TOKEN_TARGETS, agentx_stats
from bench.replay.hints_cli import run_hints
from bench.replay.metrics import CostModel
from bench.replay.report import markdown_table, plot_sweep, series_from_points, summary_rows, summary_title
from bench.replay.run import Workload, run_point
from bench.replay.tiers import POLICIES, StoreSpec, fmt_tokens
from bench.replay.writes_cli import run_writes
from bench.replay.trace import BLOCK_TOKENS, DEFAULT_TRACE, Convention, Request, cut_trace, load_trace, write_trace
from bench.replay.verdict import EXIT_MISMATCH, all_mismatches
from kvstore.policies.admission import WRITE_MODES

__all__ = ["main", "build_parser"]

# Default sweep capacities (tokens), (full, quick). AgentX's are smaller: at 100 sessions an hour its working
# set is ~3M tokens (1M..50M would be flat at the maximum), and they are multiplied by its --scale.
SWEEPS = {
    "trace": ((1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000),
              (1_000_000, 3_000_000, 10_000_000, 50_000_000)),
    "agentx": ((100_000, 300_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000),
               (100_000, 200_000, 400_000, 1_000_000)),
}
# The sweep's RAM+disk line (tokens): its RAM size and disk sizes (full, quick). AgentX's RAM is smaller
# than its headline, where RAM alone already holds the working set and a disk would add nothing.
DISK_SWEEPS = {
    "trace": (3_000_000, (10_000_000, 30_000_000, 50_000_000), (10_000_000, 30_000_000)),
    "agentx": (1_000_000, (500_000, 1_000_000, 2_000_000, 4_000_000), (500_000, 2_000_000)),
}
QUICK_DISK_TOKENS = 30_000_000
QUICK_WINDOW_S = 900.0
QUICK_AGENTX = {"sessions": 20, "scale": 0.25}
# --hints --quick: twice the sessions, so that at 10 % of unique KV with the default --ram-share 0.5 the disk
# tier still has the segments the daemon needs (20 sessions give it 2 of 1 MiB; it needs 3)
QUICK_AGENTX_HINTS = {"sessions": 40, "scale": 0.25}


def parse_tokens(text: str) -> int:
    """'3M', '500K', '1.5M', '3000000' -> tokens."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: use a token count such as 3000000, 3M or 500K")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6}[m.group(2).lower()])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace (Mooncake format)")
    src.add_argument("--agentx", action="store_true", help="generate an AgentX-shaped trace instead")
    p.add_argument("--sessions", type=int, default=100, help="AgentX sessions")
    p.add_argument("--scale", type=float, default=1.0, help="AgentX token scale")
    p.add_argument("--seed", type=int, default=0, help="AgentX seed")
    p.add_argument("--write-trace", type=Path, help="also write the generated AgentX trace here")
    p.add_argument("--capacity-tokens", type=parse_tokens, help="RAM tier capacity in tokens [3M; AgentX: 3M x scale]")
    p.add_argument("--disk-tokens", type=parse_tokens,
                   help="disk tier capacity in tokens, 0 = none [0; --quick: 30M x scale]")
    p.add_argument("--unique-share", type=float,
                   help="size RAM + disk to this share of the trace's unique KV tokens (instead of the two above)")
    p.add_argument("--ram-share", type=float, default=0.5, help="with --unique-share: RAM's part of it")
    p.add_argument("--no-baseline", action="store_true", help="with a disk tier: skip the RAM-alone replay")
    p.add_argument("--disk-reinsert-hits", type=int, default=1,
                   help="disk second chance: keep records read this many times at reclamation (0: plain FIFO)")
    p.add_argument("--disk-write", choices=WRITE_MODES, default="evict",
                   help="when the disk tier is written: evict (RAM's victims) or commit (write-behind)")
    p.add_argument("--disk-admission", default="always", help="which blocks the disk takes: always, seen:N, never")
    p.add_argument("--policy", choices=POLICIES, default="lru", help="the RAM tier's eviction policy")
    p.add_argument("--writes", action="store_true",
                   help="disk_write x admission (the store) and write budgets (the simulator) at one store")
    p.add_argument("--sim-only", action="store_true", help="with --writes: every point from the simulator")
    p.add_argument("--bytes-per-token", type=int, default=64, help="KV bytes a token (64: a block is 32 KiB)")
    p.add_argument("--partial-blocks", choices=("drop", "keep"), default="drop",
                   help="drop: only full 512-token blocks are cached (vLLM); keep: every hash id (dataset README)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--window-s", type=float, help="replay only the first S seconds of the trace")
    p.add_argument("--quick", action="store_true", help="a cut-down run (< 3 minutes on 2 cores)")
    p.add_argument("--sweep", action="store_true",
                   help="replay RAM alone at several capacities and RAM + disk at several disk sizes; "
                        "plot and table to --out")
    p.add_argument("--capacities", type=lambda s: [parse_tokens(x) for x in s.split(",")],
                   help="sweep: RAM-only capacities, e.g. 1M,3M,10M")
    p.add_argument("--disk-capacities", type=lambda s: [parse_tokens(x) for x in s.split(",")],
                   help="sweep: disk sizes of the RAM+disk line, e.g. 10M,30M,50M (its RAM: --capacity-tokens)")
    p.add_argument("--hints", action="store_true",
                   help="AgentX with agent hints: LRU, LRU + hints (the store) and Belady at --hint-shares")
    p.add_argument("--hint-shares", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.25],
                   help="with --hints: shares of unique KV to size RAM + disk to (RAM: --ram-share of it)")
    p.add_argument("--prefill-rate", type=float, default=20_000.0, help="capacity model: prefill tokens/s")
    p.add_argument("--decode-rate", type=float, default=50.0, help="capacity model: decode tokens/s per call")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="directory for the sweep's files")
    return p


def _workload(a: argparse.Namespace, model: CostModel) -> tuple[Workload, float]:
    """The requests to replay and the factor applied to default capacities."""
    conv = Convention.FULL_BLOCKS if a.partial_blocks == "drop" else Convention.KEEP_PARTIAL
    if a.agentx:
        quick = QUICK_AGENTX_HINTS if a.hints else QUICK_AGENTX
        sessions, scale = (quick["sessions"], quick["scale"]) if a.quick else (a.sessions, a.scale)
        params = AgentXParams(sessions=int(sessions), scale=float(scale), seed=a.seed, hints=a.hints)
        reqs: list[Request] = generate(params)
        if a.write_trace:
            write_trace(a.write_trace, reqs)
        name = f"agentx(sessions={params.sessions},scale={params.scale:g},seed={params.seed})"
        cut = f"quick: {params.sessions} sessions at scale {params.scale:g}" if a.quick else None
        factor = params.scale
    else:
        reqs = load_trace(a.trace)
        name, cut, factor = a.trace.name, None, 1.0
        if a.quick and a.limit is None and a.window_s is None:
            a.window_s = QUICK_WINDOW_S
    if a.limit is not None or a.window_s is not None:
        total = len(reqs)
        reqs = cut_trace(reqs, limit=a.limit, window_s=a.window_s)
        window = f"first {a.window_s:g} s, " if a.window_s is not None else ""
        cut = f"{window}first {len(reqs)} of {total} requests" + (" (quick)" if a.quick else "")
    return Workload(name, cut, reqs, conv, model), factor


def _specs(a: argparse.Namespace, w: Workload, factor: float) -> list[StoreSpec]:
    """Every store to replay, the headline first (then RAM alone at its size, then the sweep). ValueError for a
    bad size, so it fails before any daemon starts."""
    bpt = a.bytes_per_token
    if a.unique_share is not None:
        if a.capacity_tokens is not None or a.disk_tokens is not None:
            raise ValueError("--unique-share sizes RAM and disk itself: drop --capacity-tokens / --disk-tokens")
        if not (0 < a.unique_share and 0 < a.ram_share <= 1):
            raise ValueError("--unique-share must be > 0 and --ram-share in (0, 1]")
        total = int(a.unique_share * w.max_result().resident[0] * BLOCK_TOKENS)
        ram, disk = int(total * a.ram_share), total - int(total * a.ram_share)
    else:
        ram = a.capacity_tokens or int(3_000_000 * factor)
        disk = a.disk_tokens if a.disk_tokens is not None else int(QUICK_DISK_TOKENS * factor) if a.quick else 0
    hits = a.disk_reinsert_hits
    writes = {"disk_write": a.disk_write, "disk_admission": a.disk_admission}
    head = StoreSpec.ram_disk(ram, disk, bpt, hits, a.policy, **writes)
    specs = [head]
    if disk and not a.no_baseline:
        specs.append(StoreSpec.ram(ram, bpt, a.policy))
    if a.sweep:
        kind = "agentx" if a.agentx else "trace"
        full, quick = SWEEPS[kind]
        caps = a.capacities or [int(c * factor) for c in (quick if a.quick else full)]
        specs += [StoreSpec.ram(c, bpt, a.policy) for c in caps]
        line_ram, dfull, dquick = DISK_SWEEPS[kind]
        line_ram = a.capacity_tokens or int(line_ram * factor)
        disks = a.disk_capacities or [int(d * factor) for d in (dquick if a.quick else dfull)]
        specs += [StoreSpec.ram(line_ram, bpt, a.policy)] + [
            StoreSpec.ram_disk(line_ram, d, bpt, hits, a.policy, **writes) for d in disks if d]
    unique: dict[tuple[int, int], StoreSpec] = {}
    for spec in specs:
        unique.setdefault((spec.ram_tokens, spec.disk_tokens), spec)
    return list(unique.values())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    t0 = time.perf_counter()
    model = CostModel(a.prefill_rate, a.decode_rate)
    if a.hints and not a.agentx:
        parser.error("--hints needs --agentx: only the AgentX generator knows what an agent runtime would say")
    w, factor = _workload(a, model)
    if not w.requests:
        print("no requests to replay (check --limit / --window-s)", file=sys.stderr)
        return 1
    if a.hints and a.writes:
        parser.error("--hints and --writes are separate runs: choose one")
    if a.hints:
        return run_hints(a, w, parser)
    if a.writes:
        return run_writes(a, w, parser)
    try:  # a bad size fails here, before any daemon starts
        specs = _specs(a, w, factor)
    except ValueError as exc:
        parser.error(str(exc))
    extra: dict = {}
    if a.agentx:
        extra["agentx"] = agentx_stats(w.requests)
        scaled = {k: (v * factor if k in TOKEN_TARGETS else v) for k, v in TARGETS.items()}
        rows = [(k, v, f"{scaled[k]:g}" if k in scaled else "") for k, v in extra["agentx"].items()]
        print_table(f"AgentX generator check (measured from the records; token targets x scale {factor:g})",
                    ["statistic", "measured", "target"], rows)
    points = []
    with progress(len(w.requests) * len(specs)) as bar:
        for spec in specs:
            disk = f" + disk {fmt_tokens(spec.disk_tokens)}" if spec.disk_tokens else ""
            bar.step(f"{w.name[:24]} RAM {fmt_tokens(spec.ram_tokens)}{disk}")
            points.append(run_point(w, spec, bar.advance))
    head = points[0]
    print_table(summary_title(head), ["figure", "value"], summary_rows(head))
    result = {**head, **extra}
    base = next((p for p in points[1:] if p["capacity_tokens"] == head["capacity_tokens"] and not p["disk_tokens"]
                 and head["disk_tokens"]), None)
    if base is not None:
        result["ram_only"] = {k: base[k] for k in ("hit_rate", "sim_hit_rate", "hit_rate_of_max", "prefill_reduction",
                                                   "belady_hit_rate", "lru_share_of_belady",
                                                   "mismatched_requests", "tier_mismatches", "replay_s", "conditions",
                                                   "misses_by_cause", "prefix_lookups_short", "miss_causes_add_up")}
        print(f"RAM {fmt_tokens(head['capacity_tokens'])} alone: hit rate {base['hit_rate']:.4f} "
              f"({base['hit_rate_of_max']:.1%} of the maximum), prefill reduction {base['prefill_reduction']:.2f}x")
    if a.sweep:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9]+", "_", w.name).strip("_") + ("_quick" if a.quick else "_cut" if w.cut else "")
        title = f"Hit rate vs capacity (RAM, RAM + disk): {w.name}" + (f" ({w.cut})" if w.cut else "")
        table = markdown_table(points, title)
        (a.out / f"sweep_{stem}.md").write_text(table)
        png = plot_sweep(series_from_points(points), head["max_hit_rate"], a.out / f"sweep_{stem}.png",
                         f"{w.name}{' (quick)' if a.quick else ' (cut)' if w.cut else ''}: hit rate vs capacity")
        print(table)
        keep = ("capacity_tokens", "disk_tokens", "total_tokens", "store", "hit_rate", "sim_hit_rate", "hit_rate_ram",
                "hit_rate_disk", "hit_rate_of_max", "prefill_reduction", "belady_hit_rate", "lru_share_of_belady",
                "mismatched_requests", "tier_mismatches", "misses_by_cause", "miss_causes_add_up",
                "disk_reinserted_blocks", "disk_write_amplification", "disk_written_per_served", "load_gbps", "put_gbps",
                "requests_per_s", "replay_s", "conditions")
        result.update(sweep=[{k: p[k] for k in keep} for p in points], plot=str(png),
                      table=str(a.out / f"sweep_{stem}.md"))
    bad = all_mismatches(points)
    result.update(exact=not bad, mismatches=bad[:20], elapsed_s=round(time.perf_counter() - t0, 1))
    if bad:
        print(f"MISMATCH: the store differs from its exact simulation in {len(bad)} ways; first:", file=sys.stderr)
        for line in bad[:10]:
            print(f"  {line}", file=sys.stderr)
    print(json.dumps(result, separators=(",", ":")))
    return EXIT_MISMATCH if bad else 0
