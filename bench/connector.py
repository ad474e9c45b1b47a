"""The vLLM connector's worker side against the copy limit of the same bytes, measured in the same run (issue 5).

On the CPU, the KV of one long prompt goes through `kvstore_connector.worker.WorkerSide` and a real daemon (RAM tier
only): save as vLLM's wait_for_save does it, load as start_load_kv does it. The limit is the connector's own
copy (kvstore._native.copy_addrs) of the same number of bytes as one range between two pre-faulted buffers, at
1 and at 2 threads, the faster one (bench/copy_limit.py says why not np.copyto), timed round-robin with the
connector (untimed warm-up, medians; see bench/_common.py). `--help` says what each measurement is; the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


from bench._common import (Case, Samples, arena_for, emit_json, fmt_bytes, gbs, interleave, pressure, print_table,
                           progress)
from bench.connector_phases import profile
from bench.connector_rig import BLOCK_TOKENS, HEAD_DIM, KV_HEADS, LAYERS, Bench, BenchError
from bench.copy_limit import LIMIT_THREADS, best_limit
from kvstore_connector.config import ConnectorConfig
from kvstore.client.spare_puts import MAX_BLOCKS as SPARE_SLOTS
from kvstore.testing import DaemonProcess

__all__ = ["BenchError", "Plan", "FULL", "QUICK", "run", "summarize", "main"]   # BenchError: the rig raises it

HEAD_CHUNK = 8192       # vLLM's max_num_batched_tokens for `vllm serve` on a >= 70 GiB GPU: one step's prefill
EXTRA_CHUNKS = (0, 512)  # 0: the whole prompt in one step; 512: a small chunked-prefill budget
SAMPLE = 8              # blocks stamped before every save and compared after every load (untimed)
TARGET = 0.5
DEFAULT_THREADS = ConnectorConfig().copy_threads
SHAPE = f"(2, num_blocks, {BLOCK_TOKENS}, {KV_HEADS}, {HEAD_DIM})"
HEADLINE = f"copy_threads={DEFAULT_THREADS}, chunks of {HEAD_CHUNK}"

EPILOG = f"""measurements (one daemon, RAM only; cases timed round-robin, one iteration each per round; medians):
  limit       kvstore's native copy (what the connector's CpuCopier runs) of the whole KV cache (exactly the
              bytes a save moves) as ONE range into another pre-faulted buffer, at threads=1 and threads=2; the
              faster median is the limit (limit_threads). One range, not the save's 64 pieces a block: the
              best this box does with those bytes. np.copyto of the same range: informational only.
  KV cache    {LAYERS} per-layer tensors {SHAPE} bf16 (vLLM's FlashAttention and CPU
              layout), views of one pre-faulted buffer (separate allocations would give the same copy plan: no
              piece is adjacent to another on both sides). One vLLM block = 2 MiB across layers, one key
              (blocks_per_key "auto" -> 1); the request's block table is a fixed random permutation.
  save        what wait_for_save does for one prefill: SchedulerSide.build makes the SaveJobs of a fresh prompt
              (untimed), step by step in chunks of C tokens (C = {HEAD_CHUNK}, the headline: `vllm serve`'s
              max_num_batched_tokens on a >= 70 GiB GPU; also the whole prompt in one step and C = 512, for
              copy_threads={DEFAULT_THREADS}); timed: WorkerSide.save(jobs) per step (Reserve,
              batched gather into the arena, Commit queued) then drain() (every Commit done). Before each save
              (untimed) the previous prompt's keys are deleted and {SAMPLE} random blocks plus the first and the last
              are stamped with new bytes; after
              it the counters must say every key was saved (none skipped, none failed) and Exists must agree.
  load        WorkerSide.start_loads([one LoadJob of the last saved prompt's keys]) + drain(): Lookup with a
              lease, batched scatter into the request's blocks, generation check, Release. Before (untimed) the
              stamped blocks are overwritten; after, they must equal the saved bytes and loaded_blocks the
              key count.
  phases      one instrumented save and load ({HEADLINE}) outside the medians: ms in each
              call (the Commits run on the worker's commit thread, overlapping the next step's gather).
targets: save_ratio, load_ratio >= {TARGET} ({HEADLINE} tokens, over the limit).
--model gemma3-like: a hybrid KV layout, window_save trim vs all (bench/connector_hybrid.py says what it measures)."""


@dataclass(frozen=True)
class Plan:
    tokens: int
    rounds: int
    warmup: int


FULL, QUICK = Plan(32768, 5, 1), Plan(8192, 3, 1)


def _then(first: Callable[[Any], object] | None, after: Callable[[], object]) -> Callable[[Any], None]:
    def both(arg: Any) -> None:
        if first is not None:
            first(arg)
        after()
    return both


def run(tokens: int, *, rounds: int, warmup: int, threads: Sequence[int] = (1, 2),
        head_threads: int = DEFAULT_THREADS, head_chunk: int = HEAD_CHUNK, extra_chunks: Sequence[int] = EXTRA_CHUNKS,
        sample: int = SAMPLE, quick: bool = False) -> tuple[dict[str, Any], list[list[object]]]:
    """The benchmark's core: (JSON object, table rows). Raises BenchError when a pass did not move every byte
    it was meant to."""
    threads = sorted(set(threads) | {head_threads})
    blocks = tokens // BLOCK_TOKENS
    block_bytes = 2 * LAYERS * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * 2
    # one vLLM block is one key here: each worker side's bank of spare slots (kvstore_connector/saves.py) holds 64
    arena = arena_for(blocks * block_bytes, len(threads) * SPARE_SLOTS * block_bytes)
    # other step sizes: the whole prompt in one step (when that is not the headline already), smaller chunks
    extra = [c for c in dict.fromkeys(extra_chunks) if c != head_chunk and (0 < c < tokens or
                                                                           (c == 0 and head_chunk < tokens))]
    n_cases = len(LIMIT_THREADS) + 1 + 2 * len(threads) + len(extra)
    out: dict[str, Any] = {"quick": quick, "tokens": tokens, "blocks": blocks, "block_bytes": block_bytes,
                           "layout": f"{LAYERS} x {SHAPE} bf16",
                           "rounds": rounds, "warmup": warmup, "copy_threads": head_threads,
                           "copy_threads_measured": threads, "chunk_tokens": head_chunk, "arena_bytes": arena}
    t_start, psi0 = time.perf_counter(), pressure()
    with progress((warmup + rounds) * n_cases + 3) as pg:
        pg.step(f"daemon with a {fmt_bytes(arena)} arena")
        with contextlib.closing(DaemonProcess(arena_bytes=arena, max_block_bytes=block_bytes)) as d:
            d.start(timeout_s=180)      # pre-faulting a 4.6 GiB arena on a busy 2-core box can take a while
            pg.advance()
            pg.step(f"KV cache of {fmt_bytes(blocks * block_bytes)}: filling")
            b = Bench(d, tokens, threads, sample)
            pg.advance()
            try:
                cases = b.limit_cases(pg.step)
                for t in threads:   # each load right after a save: it loads (and checks) that prompt
                    cases[f"save{t}"] = b.save_case(t, head_chunk, pg.step, record_steps=t == head_threads)
                    cases[f"load{t}"] = b.load_case(t, pg.step)
                for c in extra:
                    cases[f"save{head_threads}_chunk{c}"] = b.save_case(head_threads, c, pg.step)
                cases = {k: Case(v.fn, v.setup, _then(v.teardown, pg.advance)) for k, v in cases.items()}
                res = interleave(cases, warmup=warmup, min_iters=rounds, max_iters=rounds, budget_s=0.0)
                pg.step("one instrumented save and load")
                phases = profile(b, head_threads, head_chunk, pg.step)
                pg.advance()
            finally:
                b.close()
    out["steps_per_prompt"] = -(-tokens // head_chunk) if 0 < head_chunk < tokens else 1
    out["keys"], out["bytes"] = b.keys, b.nbytes
    out["checks"] = dict(b.counts, sample_blocks=len(b.sample), saved_blocks_per_pass=b.keys)
    out["phases_ms"] = phases
    if b.step_seconds:
        out["wait_for_save_ms_p50"] = round(statistics.median(b.step_seconds) * 1e3, 1)
    rows = summarize(res, b.nbytes, out, threads, head_threads, head_chunk, extra)
    out["elapsed_s"] = elapsed = round(time.perf_counter() - t_start, 1)
    out.update({f"{k}_pressure_pct": round(100 * (v - psi0[k]) / elapsed, 1) for k, v in pressure().items()
                if k in psi0}, load_avg_1m=round(os.getloadavg()[0], 2))
    return out, rows


def summarize(res: dict[str, Samples], nbytes: int, out: dict[str, Any], threads: Sequence[int], head: int,
              chunk: int, extra: Sequence[int]) -> list[list[object]]:
    """Fill `out` with GB/s and ratios over the limit (of medians, and the median of per-round ratios); the
    table rows. `memcpy_gbs` keeps its name and is the limit's GB/s."""
    best = best_limit(res)
    lim = best.samples
    rows: list[list[object]] = []

    ratios: dict[str, float] = {}

    def row(name: str, key: str, what: str, t: object, steps: object) -> None:
        s = res[key]
        g = gbs(nbytes, s.p50)
        ratios[name] = ratio = lim.p50 / s.p50
        paired = statistics.median(m / x for m, x in zip(lim.seconds, s.seconds))
        rows.append([what, t, steps, len(s), f"{s.p50 * 1e3:.0f}", f"{s.p90 * 1e3:.0f}", f"{g:.2f}",
                     f"{ratio:.2f}", f"{paired:.2f}"])
        out[f"{name}_gbs"] = round(g, 3)
        out[f"{name}_ratio"] = round(ratio, 3)
        out[f"{name}_ratio_paired"] = round(paired, 3)

    def steps(c: int) -> str:
        return "1 (whole prompt)" if c == 0 or c >= out["tokens"] else f"{-(-out['tokens'] // c)} x {c} tokens"

    for t in LIMIT_THREADS:
        row(f"memcpy_native{t}", f"native{t}", "limit: native copy, one range" + (" = limit" if t == best.threads
                                                                                else ""), t, "")
    row("memcpy_numpy", "memcpy_numpy", "np.copyto, one range (informational)", 1, "")
    out.update(best.fields(nbytes), memcpy_gbs=round(best.gbs(nbytes), 3),
               limit_kind="kvstore._native.copy_addrs of one range, faster of threads=1 and 2")
    for op in ("save", "load"):
        for t in sorted(threads, key=lambda x: x != head):
            sfx = "" if t == head else f"_t{t}"
            row(f"{op}{sfx}", f"{op}{t}", f"{op} through WorkerSide + daemon", t, steps(chunk) if op == "save" else
                "1 LoadJob")
        if op == "save":
            for c in extra:
                row(f"save_chunk{c}", f"save{head}_chunk{c}", "save through WorkerSide + daemon", head, steps(c))
    out["targets_met"] = {f"{op}_ratio": ratios[op] >= TARGET for op in ("save", "load")}  # judged unrounded
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.connector", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"a {QUICK.tokens}-token prompt, {QUICK.rounds} rounds "
                    f"(< 1 minute); default: {FULL.tokens} tokens, {FULL.rounds} rounds")
    ap.add_argument("--tokens", type=int, help=f"prompt length (a multiple of {BLOCK_TOKENS})")
    ap.add_argument("--rounds", type=int, help="timed rounds")
    ap.add_argument("--threads", default="1,2", help="copy_threads values to measure (default 1,2)")
    ap.add_argument("--chunk", type=int, default=HEAD_CHUNK, help=f"prefill tokens per step of the headline save "
                    f"(default {HEAD_CHUNK}; 0 = the whole prompt in one step)")
    ap.add_argument("--json-out", metavar="FILE", help="also write the final JSON object to FILE")
    ap.add_argument("--model", choices=("llama", "gemma3-like"), default="llama", help="KV layout: llama (one "
                    "full-attention group, default) or gemma3-like (hybrid groups, window_save trim vs all)")
    args = ap.parse_args(argv)
    if args.model == "gemma3-like":
        from bench.connector_hybrid import main_from_args  # noqa: PLC0415 - it imports this module
        return main_from_args(args)
    plan = QUICK if args.quick else FULL
    tokens, rounds = args.tokens or plan.tokens, args.rounds or plan.rounds
    if tokens % BLOCK_TOKENS or tokens <= 0:
        ap.error(f"--tokens {tokens}: use a positive multiple of {BLOCK_TOKENS}")
    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    out, rows = run(tokens, rounds=rounds, warmup=plan.warmup, threads=threads, head_chunk=args.chunk,
                    quick=args.quick)
    print_table(f"vLLM connector worker side vs the limit (faster native copy, {out['limit_threads']} thread(s)): "
                f"{tokens} tokens = {out['keys']} keys x "
                f"{fmt_bytes(out['block_bytes'])} = {fmt_bytes(out['bytes'])} ({out['layout']}); {rounds} rounds, "
                "round-robin; GB/s of the median", ["measurement", "copy_threads", "steps", "passes", "p50 ms",
                                                    "p90 ms", "GB/s", "ratio", "ratio paired"], rows)
    cols = sorted({k for v in out["phases_ms"].values() for k in v} - {"wall", "GB/s"}) + ["wall", "GB/s"]
    print_table(f"where the time goes (one instrumented pass, copy_threads={out['copy_threads']}, ms summed over "
                "calls; Commits overlap the next step's gather on the commit thread)",
                ["pass", *cols], [[k, *(v.get(c, "") for c in cols)] for k, v in out["phases_ms"].items()])
    ck = out["checks"]
    print_table("checks (every timed and instrumented pass)", ["check", "value"], [
        ["save passes, each saved all keys (counters + Exists)",
         f"{ck['save_passes']} x {ck['saved_blocks_per_pass']}"],
        ["load passes, each loaded all keys", f"{ck['load_passes']} x {ck['saved_blocks_per_pass']}"],
        ["sampled blocks compared byte for byte after loads", ck["sample_blocks_compared"]],
        ["wait_for_save p50 per step (ms)", out.get("wait_for_save_ms_p50", "")]])
    print_table("targets", ["target", "value", "met"],
                [[f"{k} >= {TARGET}", out[k], "yes" if ok else "NO"] for k, ok in out["targets_met"].items()])
    print(f"note: the box during the run: load average {out['load_avg_1m']}, "
          + ", ".join(f"{k.split('_')[0]} pressure {v} % (some task stalled)"
                      for k, v in out.items() if k.endswith("_pressure_pct")))
    emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    main()
