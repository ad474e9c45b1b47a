"""The vLLM connector's worker side against the copy limit of the same bytes, measured in the same run (issue 5).

On the CPU, the KV of one long prompt goes through `connector.worker.WorkerSide` and a real daemon (RAM tier
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench._common import Case, Samples, emit_json, fmt_bytes, gbs, interleave, pressure, print_table, progress
from bench.connector_phases import profile
from bench.copy_limit import LIMIT_THREADS, addrs, best_limit, native_cases
from connector.config import ConnectorConfig
from connector.link import StoreLink
from connector.namespace import KVLayoutSpec, namespace_for, registration
from connector.plan import LoadJob, SaveJob
from connector.scheduler import ScheduledRequest, SchedulerSide
from connector.worker import WorkerSide
from kvstore.client import Client
from kvstore.testing import DaemonProcess, wait_until

MIB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16      # Llama-3-8B-shaped, vLLM's default block size
MODEL = "bench/llama-3-8b-shaped"
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
targets: save_ratio, load_ratio >= {TARGET} ({HEADLINE} tokens, over the limit)."""


class BenchError(RuntimeError):
    """The run did not move what it claims: a benchmark of nothing must fail, not report a number."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise BenchError(what)


@dataclass(frozen=True)
class Plan:
    tokens: int
    rounds: int
    warmup: int


FULL, QUICK = Plan(32768, 5, 1), Plan(8192, 3, 1)


class PagedCache:
    """vLLM's per-layer KV tensors over one flat, pre-faulted bf16 buffer (also the limit copy's source)."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        per_layer = 2 * num_blocks * BLOCK_TOKENS * KV_HEADS * HEAD_DIM
        self.num_blocks = num_blocks
        self.flat = torch.empty(LAYERS * per_layer, dtype=torch.bfloat16)
        self.raw = self.flat.view(torch.int16).numpy()  # the same memory (numpy has no bf16)
        rng = np.random.default_rng(seed)
        base = rng.integers(-(1 << 15), 1 << 15, size=min(8 * MIB, self.raw.size), dtype=np.int16)
        for i, start in enumerate(range(0, self.raw.size, base.size)):  # distinct bytes per block, ~1 s per 4 GiB
            part = self.raw[start:start + base.size]
            np.bitwise_xor(base[:part.size], np.int16(i), out=part)
        shape = (2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
        self.layers = {f"model.layers.{i}.self_attn.attn": self.flat[i * per_layer:(i + 1) * per_layer].view(shape)
                       for i in range(LAYERS)}
        self._np = [self.raw[i * per_layer:(i + 1) * per_layer].reshape(2, num_blocks, -1) for i in range(LAYERS)]
        self.block_bytes = self.raw.nbytes // num_blocks

    def block(self, b: int) -> bytes:
        """vLLM block b in the connector's order: layer by layer, K then V."""
        return b"".join(t[kv, b].tobytes() for t in self._np for kv in range(2))

    def stamp(self, b: int, value: int) -> None:
        for i, t in enumerate(self._np):
            for kv in range(2):
                t[kv, b] = np.int16((value * 131 + i * 2 + kv) % 32749)


@dataclass
class Request:
    """The attributes of vLLM's Request that SchedulerSide reads."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids


@dataclass
class Stored:
    """The one prompt the daemon holds between a save and the next one (the arena holds one prompt)."""

    keys: list[bytes] = field(default_factory=list)
    expected: dict[int, bytes] = field(default_factory=dict)


class Bench:
    """Everything one run shares: the daemon, the KV cache, the scheduler side, one worker side per thread count."""

    def __init__(self, d: DaemonProcess, tokens: int, threads: Sequence[int], sample: int, seed: int = 0) -> None:
        check(tokens % BLOCK_TOKENS == 0 and tokens > 0, f"tokens={tokens}: use a multiple of {BLOCK_TOKENS}")
        self.tokens, self.blocks = tokens, tokens // BLOCK_TOKENS
        self.cache = PagedCache(self.blocks, seed)
        config = ConnectorConfig.from_extra({"address": d.address})
        g = config.resolve_blocks_per_key(self.cache.block_bytes)
        self.spec = KVLayoutSpec(MODEL, "bfloat16", BLOCK_TOKENS, LAYERS, KV_HEADS, HEAD_DIM, 0, 1, g)
        check(self.spec.block_bytes == self.cache.block_bytes, "the layout spec and the cache disagree")
        self.keys = self.blocks // g
        self.nbytes = self.keys * g * self.cache.block_bytes
        self.ns = namespace_for(self.spec)
        self.client = Client(d.address)
        check(self.client.mode == "arena", f"expected the arena path, got {self.client.mode}")
        self.sched = SchedulerSide(config, self.spec, self._link(d.address, config))
        self.workers: dict[int, WorkerSide] = {}
        for t in threads:
            cfg = ConnectorConfig.from_extra({"address": d.address, "copy_threads": t})
            w = WorkerSide(cfg, self.spec, self._link(d.address, cfg))
            w.register(self.cache.layers, self.blocks)
            self.workers[t] = w
        rng = np.random.default_rng(seed + 1)
        self.table = rng.permutation(self.blocks).tolist()        # a busy server's scattered block table
        picks = {self.table[0], self.table[-1], *rng.choice(self.blocks, size=min(sample, self.blocks)).tolist()}
        self.sample = sorted(int(b) for b in picks)
        self.stored = Stored()
        self.n_prompts = 0
        self.counts = {"save_passes": 0, "load_passes": 0, "saved_blocks": 0, "loaded_blocks": 0,
                       "sample_blocks_compared": 0}
        self.step_seconds: list[float] = []

    def _link(self, address: str, cfg: ConnectorConfig) -> StoreLink:
        return StoreLink(address, timeout_s=cfg.load_timeout_s, copy_threads=cfg.copy_threads,
                         namespace_spec=lambda _n: registration(self.spec))

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
            w.link.close()
        self.sched.link.close()
        self.client.close()

    # -- prompts -----------------------------------------------------------------------------------------
    def prompt_steps(self, chunk: int) -> list[list[SaveJob]]:
        """The SaveJobs vLLM's scheduler side issues, step by step, for a fresh prompt prefilled in chunks."""
        self.n_prompts += 1
        rid = f"bench-{self.n_prompts}"
        req = Request(rid, [self.n_prompts] + [(7 * i) % 32000 for i in range(1, self.tokens)])  # fresh keys
        self.sched.track(req)
        steps: list[list[SaveJob]] = []
        done, have = 0, 0
        while done < self.tokens:
            n = min(chunk or self.tokens, self.tokens - done)
            need = -(-(done + n) // BLOCK_TOKENS)            # vLLM allocates the blocks this step writes
            plan = self.sched.build([ScheduledRequest(rid, self.table[have:need], done == 0, n)])
            steps.append(plan.saves)
            done, have = done + n, need
            req.num_computed_tokens = done
        self.sched.build([], finished_req_ids={rid})
        return steps

    def forget_stored(self) -> None:
        """Delete the prompt the daemon holds (after its leases are back), so the next save copies every key."""
        if self.stored.keys:
            wait_until(lambda: self.client.stats().leases_active == 0, what="the loads' leases to be released")
            n = self.client.delete(self.ns, self.stored.keys)
            check(n == len(self.stored.keys), f"deleted {n} of {len(self.stored.keys)} stored keys")
            self.stored = Stored()

    # -- cases -------------------------------------------------------------------------------------------
    def save_case(self, t: int, chunk: int, tick: Callable[[str], None], record_steps: bool = False) -> Case:
        w = self.workers[t]
        label = f"save copy_threads={t} chunk={chunk or 'prompt'}"

        def setup() -> tuple[list[list[SaveJob]], dict[str, float]]:
            tick(label)
            self.forget_stored()
            steps = self.prompt_steps(chunk)
            for b in self.sample:
                self.cache.stamp(b, self.n_prompts)
            return steps, dict(w.counters.totals)

        def fn(arg: tuple[list[list[SaveJob]], dict[str, float]]) -> None:
            for jobs in arg[0]:
                t0 = time.perf_counter()
                w.save(jobs)                    # what wait_for_save runs each step
                if record_steps:
                    self.step_seconds.append(time.perf_counter() - t0)
            w.drain()

        def teardown(arg: tuple[list[list[SaveJob]], dict[str, float]]) -> None:
            steps, before = arg
            keys = [k for jobs in steps for j in jobs for k in j.keys]
            got = {k: w.counters.totals.get(k, 0) - before.get(k, 0)
                   for k in ("saved_blocks", "saved_bytes", "save_skipped_blocks", "save_failures")}
            check(len(keys) == self.keys, f"the scheduler side asked to save {len(keys)} keys, expected {self.keys}")
            check(got == {"saved_blocks": self.keys, "saved_bytes": self.nbytes, "save_skipped_blocks": 0,
                          "save_failures": 0}, f"{label}: counters {got}, expected {self.keys} keys saved")
            check(all(self.client.exists(self.ns, keys)), f"{label}: not every saved key is in the store")
            self.stored = Stored(keys, {b: self.cache.block(b) for b in self.sample})
            self.counts["save_passes"] += 1
            self.counts["saved_blocks"] += got["saved_blocks"]
        return Case(fn, setup, teardown)

    def load_case(self, t: int, tick: Callable[[str], None]) -> Case:
        w = self.workers[t]
        label = f"load copy_threads={t}"

        def setup() -> tuple[LoadJob, dict[str, float]]:
            tick(label)
            check(bool(self.stored.keys), "a load needs a saved prompt: run a save case first")
            for b in self.sample:
                self.cache.stamp(b, 0)          # overwrite: the load must bring the saved bytes back
            g = self.spec.blocks_per_key
            job = LoadJob(f"load-{self.n_prompts}", None, self.stored.keys, self.table[:len(self.stored.keys) * g])
            return job, dict(w.counters.totals)

        def fn(arg: tuple[LoadJob, dict[str, float]]) -> None:
            w.start_loads([arg[0]])
            w.drain()

        def teardown(arg: tuple[LoadJob, dict[str, float]]) -> None:
            job, before = arg
            sent, recv = w.finished(set())
            check(recv == {job.req_id} and not sent, f"{label}: finished() said {sent}, {recv}")
            failed = w.load_errors()
            got = {k: w.counters.totals.get(k, 0) - before.get(k, 0)
                   for k in ("loaded_blocks", "loaded_bytes", "load_failed_blocks")}
            check(not failed and got == {"loaded_blocks": self.keys, "loaded_bytes": self.nbytes,
                                         "load_failed_blocks": 0},
                  f"{label}: counters {got}, {len(failed)} failed blocks; expected {self.keys} keys loaded")
            bad = [b for b in self.sample if self.cache.block(b) != self.stored.expected[b]]
            check(not bad, f"{label}: blocks {bad} differ from the bytes saved")
            self.counts["load_passes"] += 1
            self.counts["loaded_blocks"] += got["loaded_blocks"]
            self.counts["sample_blocks_compared"] += len(self.sample)
        return Case(fn, setup, teardown)

    def limit_cases(self, tick: Callable[[str], None]) -> dict[str, Case]:
        """native1, native2: the limit's candidates; memcpy_numpy: np.copyto of the same range (informational)."""
        src = self.cache.raw[:self.nbytes // self.cache.raw.itemsize]   # exactly the bytes one save moves
        dst = np.empty_like(src)
        dst.fill(0)                             # pre-fault
        triple = addrs([dst], [src])

        def make() -> Any:
            tick("limit: native copy")
            return triple
        return {**native_cases(make), "memcpy_numpy": Case(lambda _: np.copyto(dst, src),
                                                           lambda: tick("np.copyto (informational)"))}


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
    arena = -(-int(blocks * block_bytes / 0.9) // MIB) * MIB + 64 * MIB   # stays under the eviction watermark
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
    args = ap.parse_args(argv)
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
