"""`python -m bench.replay`: replay a trace (or an AgentX-shaped one) through the real store and the simulator.

stdout: a short human summary (and the sweep's markdown table), then, as its LAST line, exactly one JSON object
with every figure (see run.py for the names). stderr: the progress bar and notes. Exit status 2 when the
store's hit rate differs from the simulated one by more than one point: that is a finding, not noise.

--quick cuts (and says so in the JSON's "cut"): a trace file to its first 15 minutes (~3,000 of the
conversation trace's 12,031 requests), AgentX to 20 sessions at scale 0.25, a sweep to 4 capacities.
AgentX's default capacities (3M tokens, and the sweep's) are multiplied by its --scale, since every token
count of the trace is; its sweep spans 100K..5M tokens, where its working set lies.
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
from bench.replay.metrics import CostModel
from bench.replay.report import markdown_table, plot_sweep, series_from_points, summary_rows, summary_title
from bench.replay.run import Workload, run_point
from bench.replay.tiers import StoreSpec, fmt_tokens
from bench.replay.trace import DEFAULT_TRACE, Convention, Request, cut_trace, load_trace, write_trace

__all__ = ["main", "build_parser"]

# Default sweep capacities (tokens), (full, quick). AgentX's are smaller: at 100 sessions an hour its working
# set is ~3M tokens (1M..50M would be flat at the maximum), and they are multiplied by its --scale.
SWEEPS = {
    "trace": ((1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000),
              (1_000_000, 3_000_000, 10_000_000, 50_000_000)),
    "agentx": ((100_000, 300_000, 500_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000),
               (100_000, 200_000, 400_000, 1_000_000)),
}
QUICK_WINDOW_S = 900.0
QUICK_AGENTX = {"sessions": 20, "scale": 0.25}


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
    p.add_argument("--bytes-per-token", type=int, default=64, help="KV bytes a token (64: a block is 32 KiB)")
    p.add_argument("--partial-blocks", choices=("drop", "keep"), default="drop",
                   help="drop: only full 512-token blocks are cached (vLLM); keep: every hash id (dataset README)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--window-s", type=float, help="replay only the first S seconds of the trace")
    p.add_argument("--quick", action="store_true", help="a cut-down run (< 3 minutes on 2 cores)")
    p.add_argument("--sweep", action="store_true", help="replay at several RAM capacities; plot and table to --out")
    p.add_argument("--capacities", type=lambda s: [parse_tokens(x) for x in s.split(",")],
                   help="sweep capacities, e.g. 1M,3M,10M")
    p.add_argument("--prefill-rate", type=float, default=20_000.0, help="capacity model: prefill tokens/s")
    p.add_argument("--decode-rate", type=float, default=50.0, help="capacity model: decode tokens/s per call")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="directory for the sweep's files")
    return p


def _workload(a: argparse.Namespace, model: CostModel) -> tuple[Workload, float]:
    """The requests to replay and the factor applied to default capacities."""
    conv = Convention.FULL_BLOCKS if a.partial_blocks == "drop" else Convention.KEEP_PARTIAL
    if a.agentx:
        sessions, scale = (QUICK_AGENTX["sessions"], QUICK_AGENTX["scale"]) if a.quick else (a.sessions, a.scale)
        params = AgentXParams(sessions=int(sessions), scale=float(scale), seed=a.seed)
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


def _capacities(a: argparse.Namespace, factor: float) -> tuple[int, list[int]]:
    headline = a.capacity_tokens or int(3_000_000 * factor)
    if not a.sweep:
        return headline, [headline]
    full, quick = SWEEPS["agentx" if a.agentx else "trace"]
    base = a.capacities or [int(c * factor) for c in (quick if a.quick else full)]
    return headline, sorted(set(base) | {headline})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    t0 = time.perf_counter()
    model = CostModel(a.prefill_rate, a.decode_rate)
    w, factor = _workload(a, model)
    if not w.requests:
        print("no requests to replay (check --limit / --window-s)", file=sys.stderr)
        return 1
    headline, caps = _capacities(a, factor)
    try:  # a bad size fails here, before any daemon starts
        specs = [StoreSpec.ram(cap, a.bytes_per_token) for cap in caps]
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
    with progress(len(w.requests) * len(caps)) as bar:
        for spec in specs:
            bar.step(f"{w.name[:24]} {spec.label} {fmt_tokens(spec.ram_tokens)} tokens")
            points.append(run_point(w, spec, bar.advance))
    head = next(p for p in points if p["capacity_tokens"] == headline)
    print_table(summary_title(head), ["figure", "value"], summary_rows(head))
    result = {**head, **extra}
    if a.sweep:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9]+", "_", w.name).strip("_") + ("_quick" if a.quick else "_cut" if w.cut else "")
        table = markdown_table(points, f"Hit rate vs RAM capacity: {w.name}" + (f" ({w.cut})" if w.cut else ""))
        (a.out / f"sweep_{stem}.md").write_text(table)
        png = plot_sweep(series_from_points(points), head["max_hit_rate"], a.out / f"sweep_{stem}.png",
                         f"{w.name}{' (quick)' if a.quick else ' (cut)' if w.cut else ''}: hit rate vs capacity")
        print(table)
        keep = ("capacity_tokens", "store", "hit_rate", "sim_hit_rate", "hit_rate_of_max", "prefill_reduction",
                "mismatched_requests", "load_gbps", "put_gbps", "requests_per_s")
        result.update(sweep=[{k: p[k] for k in keep} for p in points], plot=str(png),
                      table=str(a.out / f"sweep_{stem}.md"))
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, separators=(",", ":")))
    worst = max(abs(p["hit_rate"] - p["sim_hit_rate"]) for p in points)
    return 2 if worst > 0.01 else 0
