"""`python -m bench.connector --model gemma3-like`: the connector on a hybrid (Gemma-3-like) KV layout, window
trimming on and off in the same run, against the copy limit of the same bytes (issue 18).

With vLLM's hybrid KV cache manager, a sliding-window group keeps only its window; the connector stores each KV
cache group under its own namespace, and by default (window_save "trim") a sliding group stores only the keys a
later hit can use (the window before the prompt's end and before every window_checkpoint_tokens), "all" every
key. This run saves one long prompt through kvstore_connector.scheduler.SchedulerSide + kvstore_connector.worker.WorkerSide and a
real daemon (RAM only) with both settings, reads what the daemon holds per group's namespace, and loads the hit
at the prompt's end as the scheduler plans it (sliding groups: the window only). bench/hybrid_rig.py is the rig.

Measurements (--threads: copy_threads is 2 when listed, else the first value; cases round-robin, medians):
  layout      6 KV cache groups (1 full + 5 sliding window 1024) x 2 layers, Gemma 3 4B's attention (4 KV heads
              x 256), vLLM's hybrid layout (one tensor per group position, shared by one layer of each group),
              blocks_per_key as the connector resolves it from the 6 groups' block bytes.
  save        per window_save (trim, all): the SaveJobs of a fresh prompt prefilled in --chunk steps, with block
              tables as vLLM's hybrid manager keeps them; timed: WorkerSide.save per step + drain(). Checked:
              counters, the daemon's blocks and bytes per group namespace (stored_bytes_*), Exists.
  load        the scheduler's lookup of the same prompt (untimed; it must offer the prompt's last full key) and
              its LoadJob (sliding groups: the window only); timed: start_loads + drain(). Sampled blocks
              are compared with the saved bytes.
  limit       kvstore's native copy of each measurement's bytes as one range, threads 1 and 2, the faster
              median; every ratio divides by the limit of its own bytes.
  JSON        stored_bytes_per_token_{trim,all} (the daemon's bytes over prompt tokens), trim_saving (all over
              trim), {save,load}_{gbs,ratio}_{trim,all}; the headline save_ratio, load_ratio and limit_gbs are
              the trimmed save's and its load's (targets: >= 0.5, as bench.connector).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any

from bench._common import (Case, Samples, arena_for, emit_json, fmt_bytes, gbs, interleave, pressure, print_table,
                           progress)
from bench.connector import DEFAULT_THREADS, TARGET, Plan
from bench.copy_limit import best_limit
from bench.hybrid_rig import MODES, BenchError, HybridBench, HybridShape
from kvstore_connector.config import ConnectorConfig
from kvstore.client.spare_puts import MAX_BLOCKS as SPARE_SLOTS
from kvstore.testing import DaemonProcess

__all__ = ["FULL", "QUICK", "BenchError", "run", "main_from_args"]

FULL, QUICK = Plan(32768, 5, 1), Plan(16384, 3, 1)
SAMPLE = 8
CHECKPOINT = ConnectorConfig().window_checkpoint_tokens
GEMMA3_LIKE = HybridShape()

def run(tokens: int, *, rounds: int, warmup: int, chunk: int, copy_threads: int = DEFAULT_THREADS,
        shape: HybridShape = GEMMA3_LIKE, checkpoint: int = CHECKPOINT, sample: int = SAMPLE,
        quick: bool = False) -> tuple[dict[str, Any], list[list[object]]]:
    """(JSON object, table rows). Raises BenchError when a pass did not store or load what it should."""
    all_bytes = shape.groups * tokens // shape.block_tokens * shape.group_block_bytes
    # the worker side's banks of spare slots (kvstore_connector/saves.py): 64 slots of each group's stored-block size
    g = ConnectorConfig.from_extra({}).resolve_blocks_per_key(shape.groups * shape.group_block_bytes)
    arena = arena_for(all_bytes, SPARE_SLOTS * shape.groups * shape.group_block_bytes * g)
    n_cases = 3 * 2 + 2 * len(MODES)
    out: dict[str, Any] = {"quick": quick, "model": "gemma3-like", "layout": shape.describe(), "tokens": tokens,
                           "block_tokens": shape.block_tokens, "window": shape.window, "groups": shape.groups,
                           "chunk_tokens": chunk, "window_checkpoint_tokens": checkpoint,
                           "copy_threads": copy_threads, "rounds": rounds, "warmup": warmup, "arena_bytes": arena}
    t_start, psi0 = time.perf_counter(), pressure()
    with progress((warmup + rounds) * n_cases + 3) as pg:
        pg.step(f"daemon with a {fmt_bytes(arena)} arena")
        with contextlib.closing(DaemonProcess(arena_bytes=arena, max_block_bytes=max(
                4 << 20, 16 * shape.group_block_bytes))) as d:
            d.start(timeout_s=180)
            pg.advance()
            pg.step("hybrid KV cache: filling")
            b = HybridBench(d, shape, tokens, chunk, copy_threads=copy_threads, sample=sample, checkpoint=checkpoint)
            pg.advance()
            try:
                keys = {m: b.planned_keys(m) for m in MODES}
                sizes = {f"save_{m}": sum(keys[m]) * b.key_bytes for m in MODES} | {"load": b.load_bytes}
                limits = b.limit_cases(sizes, pg.step)
                cases: dict[str, Case] = {}
                for m in MODES:   # each load right after its save: it loads (and checks) that prompt
                    cases.update({k: v for k, v in limits.items() if k.startswith(f"limit_save_{m}")})
                    cases[f"save_{m}"] = b.save_case(m, pg.step)
                    cases[f"load_{m}"] = b.load_case(m, pg.step)
                cases.update({k: v for k, v in limits.items() if k.startswith("limit_load")})
                cases = {k: Case(v.fn, v.setup, _after(v.teardown, pg.advance)) for k, v in cases.items()}
                res = interleave(cases, warmup=warmup, min_iters=rounds, max_iters=rounds, budget_s=0.0)
            finally:
                b.close()
            pg.advance()
    out.update(blocks_per_key=b.blocks_per_key, tokens_per_key=b.tokens_per_key, key_bytes=b.key_bytes,
               steps_per_prompt=len(b.prefill.steps), kv_cache_blocks=b.cache.num_blocks,
               kv_cache_peak_blocks=b.prefill.peak_blocks, hit_tokens=b.hit_tokens, load_keys=b.load_keys,
               load_bytes=b.load_bytes)
    for m in MODES:
        st = b.stats[m]
        check_keys = [n * b.key_bytes for n in keys[m]]
        if st["bytes"] != check_keys:
            raise BenchError(f"window_save={m}: the daemon holds {st['bytes']} bytes per group, planned {check_keys}")
        out[f"stored_keys_{m}"] = st["blocks"]
        out[f"stored_bytes_{m}"] = sum(st["bytes"])
        out[f"stored_bytes_per_token_{m}"] = round(sum(st["bytes"]) / tokens, 1)
    out["trim_saving"] = round(out["stored_bytes_all"] / out["stored_bytes_trim"], 3)
    out["checks"] = dict(b.counts, sample_blocks=len(b.sample))
    rows = summarize(res, sizes, out)
    out["elapsed_s"] = elapsed = round(time.perf_counter() - t_start, 1)
    out.update({f"{k}_pressure_pct": round(100 * (v - psi0[k]) / elapsed, 1) for k, v in pressure().items()
                if k in psi0}, load_avg_1m=round(os.getloadavg()[0], 2))
    return out, rows


def _after(first: Any, then: Any) -> Any:
    def both(arg: Any) -> None:
        if first is not None:
            first(arg)
        then()
    return both


def summarize(res: dict[str, Samples], sizes: dict[str, int], out: dict[str, Any]) -> list[list[object]]:
    """GB/s per measurement, each over the faster native copy of its own bytes (ratio of medians, and the median
    of per-round ratios); fills ``out``, returns the table rows."""
    rows: list[list[object]] = []
    for m in MODES:
        for op, size in (("save", sizes[f"save_{m}"]), ("load", sizes["load"])):
            lim = best_limit(res, prefix=f"limit_{op}_{m}" if op == "save" else "limit_load")
            s = res[f"{op}_{m}"]
            g, ratio = gbs(size, s.p50), lim.samples.p50 / s.p50
            paired = statistics.median(x / y for x, y in zip(lim.samples.seconds, s.seconds))
            out.update({f"{op}_gbs_{m}": round(g, 3), f"{op}_ms_{m}": round(s.p50 * 1e3, 1),
                        f"{op}_ratio_{m}": round(ratio, 3), f"{op}_ratio_paired_{m}": round(paired, 3),
                        f"limit_{op}_{m}_gbs": round(lim.gbs(size), 3), f"limit_{op}_{m}_threads": lim.threads})
            rows.append([op, m, fmt_bytes(size), len(s), f"{s.p50 * 1e3:.0f}", f"{s.p90 * 1e3:.0f}", f"{g:.2f}",
                         f"{lim.gbs(size):.2f} ({lim.threads}t)", f"{ratio:.2f}", f"{paired:.2f}"])
    out["save_ratio"], out["load_ratio"] = out["save_ratio_trim"], out["load_ratio_trim"]
    out["limit_gbs"] = out["limit_save_trim_gbs"]
    out["save_time_saving"] = round(out["save_ms_all"] / out["save_ms_trim"], 3) if out["save_ms_trim"] else 0.0
    out["targets_met"] = {k: out[k] >= TARGET for k in ("save_ratio", "load_ratio")}
    return rows


def main_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """bench.connector's main, parsed, for --model gemma3-like."""
    plan = QUICK if args.quick else FULL
    tokens, rounds = args.tokens or plan.tokens, args.rounds or plan.rounds
    bt = GEMMA3_LIKE.block_tokens
    if tokens <= 0 or tokens % bt or args.chunk < 0 or args.chunk % bt:
        raise SystemExit(f"--tokens {tokens} --chunk {args.chunk}: use multiples of {bt} (tokens > 0)")
    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    copy_threads = DEFAULT_THREADS if DEFAULT_THREADS in threads else threads[0]
    out, rows = run(tokens, rounds=rounds, warmup=plan.warmup, chunk=args.chunk, copy_threads=copy_threads,
                    quick=args.quick)
    print_table(f"vLLM connector, Gemma-3-like hybrid KV ({out['layout']}): {tokens} tokens, prefill "
                f"{out['steps_per_prompt']} step(s), copy_threads={copy_threads}; {rounds} rounds, round-robin; "
                "GB/s of the median", ["op", "window_save", "bytes", "passes", "p50 ms", "p90 ms", "GB/s",
                                       "limit GB/s", "ratio", "ratio paired"], rows)
    print_table("stored per prompt (the daemon's stats, per group namespace: group 0 full, 1.. sliding)",
                ["window_save", "keys per group", "bytes", "bytes per prompt token"],
                [[m, out[f"stored_keys_{m}"], fmt_bytes(out[f"stored_bytes_{m}"]),
                  out[f"stored_bytes_per_token_{m}"]] for m in MODES]
                + [["all / trim", "", f"{out['trim_saving']}x", ""]])
    ck = out["checks"]
    print_table("checks (every timed pass)", ["check", "value"], [
        ["save passes (counters, daemon stats per group, Exists)", ck["save_passes"]],
        ["load passes (scheduler hit, LoadJob keys per group, counters)", ck["load_passes"]],
        ["keys loaded per pass (full, sliding...)", out["load_keys"]],
        ["sampled blocks compared byte for byte after loads", ck["sample_blocks_compared"]]])
    print_table("targets", ["target", "value", "met"],
                [[f"{k} >= {TARGET}", out[k], "yes" if ok else "NO"] for k, ok in out["targets_met"].items()])
    print(f"note: the box during the run: load average {out['load_avg_1m']}, "
          + ", ".join(f"{k.split('_')[0]} pressure {v} % (some task stalled)"
                      for k, v in out.items() if k.endswith("_pressure_pct")))
    emit_json(out, args.json_out)
    return out
