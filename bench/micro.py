"""Micro-benchmarks of kvstore's hot paths against the limit measured in the same run.

Why one run: the machines are noisy (2 shared cores), so an absolute figure means little; the ratio of the store
to the limit measured on the same box in the same seconds is the number to track. Two limits: for bytes, the
copy the client itself uses (kvstore._native.copy_addrs) of the same sizes, at 1 and at 2 threads, the faster
one (bench/copy_limit.py); for the control plane, a raw unix-socket request/response of the same frames between
two Python processes (bench/uds_limit.py). The limit and the store are timed round-robin, one iteration each per
round, after untimed warm-up, and medians are reported (bench/_common.py). Every client path is measured twice:
control calls over the same-node fast path (kvstore/fastpath) and over gRPC.

Run `python -m bench.micro --help` for what each section measures. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bench import control_plane
from bench._common import Case, Samples, emit_json, fmt_bytes, gbs, interleave, print_table, progress
from bench.copy_limit import LIMIT_THREADS, ColdSources, best_limit, cold
from bench.micro_cases import KIB, MIB, bench_rss, faulted, fill_arena, get_case, keygen, limit_cases, put_case, take
from bench.micro_phases import phases
from bench.targets import Target, evaluate, mark
from bench.uds_limit import UdsPeer
from kvstore.client.fast_channel import DEFAULT_SPIN_US
from kvstore.fastpath.sockets import DAEMON_SPIN_US
from kvstore.client import Client
from kvstore.fastpath import protocol as fp
from kvstore.testing import DaemonProcess, wait_until

SIZES = (256 * KIB, 2 * MIB)
DEFAULT_THREADS: int = inspect.signature(Client).parameters["copy_threads"].default  # what users get
SINGLE_BLOCK = (8, 2)  # single-block puts/gets: consecutive calls per case and round, the first untimed
SINGLE_BLOCK_TEXT = f"{SINGLE_BLOCK[0]} calls (the first {SINGLE_BLOCK[1]} untimed)"
ISSUE = "issue 14 (same-node control plane)"
TARGETS = (
    Target("fast_lookup280_us_p50", "<=", 150, ISSUE), Target("fast_lookup280_vs_uds", "<=", 3.5, ISSUE),
    Target("fast_echo_us_p50", "<=", 80, ISSUE),
    Target("fast_probe280_us_p50", "<=", 150, ISSUE + ", the scheduler's probe"),
    Target("fast_probe280_vs_uds", "<=", 3.5, ISSUE + ", the scheduler's probe"), Target("arena_put_ratio", ">=", 0.9, ISSUE),
    Target("arena_get_ratio", ">=", 0.9, ISSUE), Target("put_2m_gbs", ">=", 5, ISSUE),
    Target("put_256k_gbs", ">=", 1.5, ISSUE), Target("bytes_per_block", "<=", 256, "the catalog's memory budget"),
)

EPILOG = f"""measurements (untimed warm-up, then medians; the cases of one section/configuration run round-robin):
  limit     kvstore._native.copy_addrs (the client's own copy) of B blocks of S bytes from fixed pre-faulted
            sources into a rotating ring of pre-faulted destinations (128 MiB+, so destinations are cold like
            fresh arena slots), S in {{256 KiB, 2 MiB}}, B in {{1, 32}}, at threads=1 and threads=2; the faster
            median is the limit of that configuration (limit_threads says which).
  arena     Client(unix socket), mode asserted 'arena', three clients: control='fast' with copy_threads=1 and 2,
            control='grpc' with copy_threads={DEFAULT_THREADS} (the default). put = B *fresh* keys (B=1 is client.put)
            into a 1 GiB arena filled first, so every put also pays steady-state LRU eviction: on the fast path a
            copy into the connection's spare slots and one Store (kvstore/client/spare_puts.py; when the slots
            are not granted, Reserve, copy, Commit), over gRPC Reserve, copy, Commit. get = B stored keys into
            pre-faulted numpy buffers (on the fast path with every key in the key index: copy and generation
            check, no round trip; else Lookup, copy, async Release; B=1 is client.get_into). Headline: copy_threads={DEFAULT_THREADS}; put_256k_gbs, put_2m_gbs, get_* are
            B=1 on the fast path, arena_*_ratio B=32 of 2 MiB over the limit; the _grpc fields the gRPC client.
            B=1 runs in blocks of {SINGLE_BLOCK_TEXT} per case and round: a call after a pause
            pays for waking the idle daemon (bench/control_plane.py), which is no part of a put. B=32 (limit
            and store alike) reads its bytes from memory: their cache lines are evicted (untimed) before each
            call (bench/copy_limit.py ColdSources), so neither copies from a cache the other was pushed out of.
  phases    extra runs of 2 MiB x 32 and 256 KiB x 1 (copy_threads=1, fast path; and 256 KiB x 1 over gRPC) with
            the control calls and copies timed separately, plus daemon and client CPU per call (schedstat).
  stream    Client(TCP, mode='stream'): streaming Put and Get of 8 x 2 MiB blocks (bytes inside gRPC):
            grpc_put_gbs / grpc_get_gbs.
  control   bench/control_plane.py: a raw unix-socket round trip of a 280-key Lookup's real frame sizes and of
            empty frames between two Python processes (the limit: uds_rtt_us_p50/p99, uds_echo_us_p50), against
            client.echo, Lookup of 280 stored 16-byte keys (prefix; no lease / lease / lease + Release) and
            Reserve + Commit of 1 x 4 KiB, on the fast path and over gRPC. Hot: blocks of consecutive calls per
            case, round-robin (targets judged here). Cold (*_cold): each call after 20 ms idle, as a scheduler
            step under load calls it. The daemon's counters must move by exactly what the cases sent
            (checks_exact), else the run fails.
  rss       a separate daemon (max_block_bytes 64 KiB) receives N 4 KiB blocks with 32-byte keys in batches of
            4096; RssAnon of the daemon after minus before, divided by N. N = 1,000,000 (--quick: 200,000).
targets: {"; ".join(f"{t.field} {t.text()}" for t in TARGETS)}"""


@dataclass(frozen=True)
class Budget:
    """How hard to try per measurement."""

    warmup: int
    min_iters: int
    budget_s: float
    max_iters: int

    def run(self, cases: dict[str, Case], block: int = 1, untimed_in_block: int = 0) -> dict[str, Samples]:
        return interleave(cases, warmup=self.warmup, min_iters=self.min_iters, budget_s=self.budget_s,
                          max_iters=self.max_iters, block=block, untimed_in_block=untimed_in_block)


@dataclass(frozen=True)
class Plan:
    """What one run measures; --quick and the full run differ in effort, tests shrink the sizes."""

    budget: Budget
    rss_blocks: int
    arena_bytes: int = 1 << 30          # holds 512 x 2 MiB, so batches of 32 keep it evicting
    batches: tuple[int, ...] = (1, 32)  # 1 gives the single put/get fields
    head_batch: int = 32                # arena_*_ratio: 2 MiB x head_batch
    stream_batch: int = 8               # 8 x 2 MiB = 16 MiB per streaming call
    lookup_keys: int = control_plane.LOOKUP_KEYS
    cold_iters: int = 25                # control-plane calls per case after an idle gap (each costs the gap)
    fallback_flush_bytes: int | None = None  # ColdSources' buffers where evict_lines does nothing (None: LLC)

    def __post_init__(self) -> None:
        if 1 not in self.batches or self.head_batch not in self.batches:
            raise ValueError(f"batches {self.batches} must hold 1 and the head batch {self.head_batch}")


QUICK = Plan(Budget(2, 5, 0.4, 2000), rss_blocks=200_000)
FULL = Plan(Budget(5, 20, 2.0, 20000), rss_blocks=1_000_000, cold_iters=100)



@dataclass
class Report:
    """Tables and fields gathered during a run; rows end with the target fields they are judged by."""

    rows: list[list[Any]] = field(default_factory=list)
    control_rows: list[list[Any]] = field(default_factory=list)
    out: dict[str, Any] = field(default_factory=dict)
    limit: dict[tuple[int, int], float] = field(default_factory=dict)
    arena: dict[tuple[str, int, int, str], float] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    cold: ColdSources | None = None  # made at the first batch section

    def row(self, name: str, s: Samples, nbytes: int, lim: float | None = None, targets: tuple[str, ...] = ()) -> float:
        """A byte-moving row; `lim` None marks the limit itself (ratio 1)."""
        g = gbs(nbytes, s.p50)
        self.rows.append([name, len(s), f"{s.p50 * 1e6:.0f}", f"{s.p90 * 1e6:.0f}", f"{g:.2f}",
                          f"{g / (lim or g):.2f}", targets])
        return g


def arena_section(r: Report, plan: Plan, clients: dict[str, Client], pid: int, size: int, batch: int) -> None:
    ns = f"bench-{size}"
    b = plan.budget
    values = [faulted(size, i % 251) for i in range(batch)]
    bufs = [faulted(size, 0) for _ in range(batch)]
    stored = take(keygen(f"get{size}x{batch}"), batch)
    c1 = clients["t1"]
    c1.put_many(ns, stored, values)  # lookups keep them recent, so the puts never evict them
    cases = limit_cases(size, batch)
    for label, c in clients.items():
        # get before put: a get's Release goes out on a background thread after it returns, so the case after a
        # get pays for it; a put rather than the limit, which then always follows a put
        cases[f"get {label}"] = get_case(c, ns, stored, bufs)
        cases[f"put {label}"] = put_case(c, ns, values, f"p{size}x{batch}{label}")
    # single blocks run in blocks of consecutive calls (bench/_common.interleave says why: a call after a pause
    # pays for waking the daemon, which is no part of a put); batches of 32 take ms, and run one call a round,
    # each reading its bytes from memory (ColdSources says why)
    if batch > 1:
        cases = _cold_sources(r, plan, cases, c1, ns, stored, values)
    res = b.run(cases, *(SINGLE_BLOCK if batch == 1 else (1, 0)))
    nbytes = size * batch
    best = best_limit(res)
    lim = r.limit[(size, batch)] = best.gbs(nbytes)
    r.out.setdefault("limit_threads_by_config", {})[f"{fmt_bytes(size)}x{batch}"] = best.threads
    for t in LIMIT_THREADS:
        g = r.row(f"limit: native copy {fmt_bytes(size)} x {batch} threads={t}" + (" = limit" if t == best.threads
                  else ""), res[f"native{t}"], nbytes, lim)
        r.out.setdefault("native_gbs_by_config", {})[f"{fmt_bytes(size)}x{batch} t{t}"] = round(g, 3)
    head = (size, batch) == (2 * MIB, plan.head_batch)
    for op in ("put", "get"):
        for label in clients:
            judged: tuple[str, ...] = ()
            if label == f"t{DEFAULT_THREADS}":
                judged = (f"arena_{op}_ratio",) if head else (f"{op}_{_short(size)}_gbs",) if batch == 1 else ()
            how = "gRPC control, copy_threads=" + str(DEFAULT_THREADS) if label == "grpc" else \
                "fast control, copy_threads=" + label[1:]
            r.arena[(op, size, batch, label)] = r.row(f"arena {op} {fmt_bytes(size)} x {batch} {how}",
                                                     res[f"{op} {label}"], nbytes, lim, judged)
    if head or (size, batch) == (256 * KIB, 1):
        n_ph = max(b.min_iters * 2, 10)
        who = [("t1", "")] + ([("grpc", " (gRPC control)")] if batch == 1 else [])
        for label, suffix in who:
            c = clients[label]
            fresh = iter([take(keygen(f"ph{size}x{batch}{label}"), batch * n_ph)[i::n_ph] for i in range(n_ph)])
            def put_op(c: Client = c, fresh: Iterator[list[bytes]] = fresh) -> object:
                return c.put_many(ns, next(fresh), values)
            r.phases[f"put {fmt_bytes(size)} x {batch}{suffix}"] = phases(c, pid, put_op, n_ph)
            c1.put_many(ns, stored, values)  # the phase puts above may have evicted them
            get = cases[f"get {label}"]
            def get_op(get: Case = get) -> object:
                return get.fn(None)
            r.phases[f"get {fmt_bytes(size)} x {batch}{suffix}"] = phases(c, pid, get_op, n_ph)


def _cold_sources(r: Report, plan: Plan, cases: dict[str, Case], c: Client, ns: str, stored: list[bytes],
                  values: list[np.ndarray]) -> dict[str, Case]:
    """Every case with its sources' cache lines evicted before each call: the limit's (its setup's addresses),
    a put's values, a get's stored blocks in the arena (where a Lookup finds them; the timed puts never evict
    them, see arena_section)."""
    cs = r.cold = r.cold or ColdSources(plan.fallback_flush_bytes)
    lengths = np.asarray([v.nbytes for v in values], np.uint64)
    put_src = np.asarray([v.ctypes.data for v in values], np.uint64)
    lease = c.lookup(ns, stored)
    span = c.arena_span
    if lease.hits != len(stored) or span is None:
        raise RuntimeError(f"the {len(stored)} stored blocks: {lease.hits} found ({c.mode} mode)")
    get_src = np.asarray(lease.offsets, np.uint64) + np.uint64(span[0])  # c's mapping lives the whole run
    c.release([lease], wait=True)

    def sources(k: str) -> Callable[[Any], object]:
        if k.startswith("native"):
            return lambda a: cs(a[1], a[2])  # the limit's setup gives Addrs: (dst, src, lengths)
        src = get_src if k.startswith("get") else put_src
        return lambda _: cs(src, lengths)
    return {k: cold(case, sources(k)) for k, case in cases.items()}


def _short(size: int) -> str:
    return {256 * KIB: "256k", 2 * MIB: "2m"}[size]


def stream_section(r: Report, plan: Plan, address: str) -> None:
    n = plan.stream_batch
    with Client(address, mode="stream") as cs:
        assert cs.mode == "stream", cs.mode
        cs.register_namespace("bench-stream")
        values = [faulted(2 * MIB, i) for i in range(n)]
        bufs = [faulted(2 * MIB, 0) for _ in range(n)]
        stored = take(keygen("stream-get"), n)
        cs.put_many("bench-stream", stored, values)
        res = plan.budget.run({**limit_cases(2 * MIB, n), "put": put_case(cs, "bench-stream", values, "stream"),
                               "get": get_case(cs, "bench-stream", stored, bufs)})
    best = best_limit(res)
    lim = best.gbs(2 * MIB * n)
    for t in LIMIT_THREADS:
        r.row(f"limit: native copy 2 MiB x {n} threads={t}" + (" = limit" if t == best.threads else ""),
              res[f"native{t}"], 2 * MIB * n, lim)
    for name in ("put", "get"):
        r.out[f"grpc_{name}_gbs"] = round(r.row(f"gRPC stream {name} 2 MiB x {n}", res[name], 2 * MIB * n, lim), 3)


def _without_key_index(address: str) -> Client:
    """A fast-path client whose probes skip the shared key index ($KVSTORE_KEY_INDEX=0 while it connects)."""
    old = os.environ.get("KVSTORE_KEY_INDEX")
    os.environ["KVSTORE_KEY_INDEX"] = "0"
    try:
        return Client(address, control="fast")
    finally:
        if old is None:
            del os.environ["KVSTORE_KEY_INDEX"]
        else:
            os.environ["KVSTORE_KEY_INDEX"] = old


def control_section(r: Report, plan: Plan, fast: Client, grpc: Client, no_index: Client) -> None:
    """bench/control_plane.py, hot then cold, with the daemon's counters checked against what the cases sent."""
    keys = control_plane.chain_keys("chain", plan.lookup_keys)
    control_plane.store_chain(fast, keys, (control_plane.LOOKUP_NS, *control_plane.TP_NAMESPACES))
    wait_until(lambda: fast.stats().leases_active == 0, timeout_s=10, what="the background Releases to land")
    _, rep = control_plane.lookup_sizes(plan.lookup_keys)
    with UdsPeer({fp.LOOKUP: rep - fp.HEADER.size}, spin_us=DEFAULT_SPIN_US, peer_spin_us=DAEMON_SPIN_US) as peer:
        cases = control_plane.Cases(fast, grpc, peer, keys, no_index)
        before = fast.stats()
        hot, cold = control_plane.run(cases, plan.budget, plan.cold_iters)
        fast.echo()  # behind the last one-way HITS (Lookups answered from the key index): they are all counted
        after = fast.stats()
    got, want = control_plane.counted(before, after), cases.expected()
    want["fast_requests"] += 1  # that Echo
    if got != want:
        raise RuntimeError(f"the daemon's counters moved by {got} over the control cases ({dict(cases.calls)} "
                           f"calls), expected {want}: a case did not do what it says")
    r.out.update(control_plane.fields(hot, cold))
    r.out["checks_exact"] = {"control_calls": dict(cases.calls), **got}
    r.control_rows = control_plane.rows(hot, cold)


def run(plan: Plan) -> Report:
    """Every section on one daemon (the RSS one on its own, after); the report's `out` is the JSON object."""
    r = Report()
    t_start = time.perf_counter()
    n_steps = len(SIZES) * (1 + len(plan.batches)) + 3
    with progress(n_steps) as pg, ExitStack() as stack:
        d = stack.enter_context(DaemonProcess(arena_bytes=plan.arena_bytes, max_block_bytes="4MiB"))
        assert d.proc is not None
        clients = {"t1": Client(d.address, copy_threads=1, control="fast"),
                   "t2": Client(d.address, copy_threads=2, control="fast"),
                   "grpc": Client(d.address, copy_threads=DEFAULT_THREADS, control="grpc")}
        for c in clients.values():
            stack.callback(c.close)
            if c.mode != "arena":
                raise RuntimeError(f"expected the arena data path, got {c.mode}")
        for size in SIZES:
            pg.step(f"fill arena with {fmt_bytes(size)} blocks")
            for other in SIZES:  # empty the arena of other size classes, so the slabs go to this one
                clients["t1"].register_namespace(f"bench-{other}")
                clients["t1"].clear(f"bench-{other}")
            fill_arena(clients["t1"], f"bench-{size}", size, plan.arena_bytes)
            pg.advance()
            for batch in plan.batches:
                pg.step(f"native copy / arena put, get {fmt_bytes(size)} x {batch}")
                arena_section(r, plan, clients, d.proc.pid, size, batch)
                pg.advance()
        pg.step("streaming gRPC put/get 2 MiB")
        stream_section(r, plan, d.tcp_address)
        pg.advance()
        pg.step("control plane: raw socket, fast path, gRPC")
        no_index = stack.enter_context(_without_key_index(d.address))
        control_section(r, plan, clients[f"t{DEFAULT_THREADS}"], clients["grpc"], no_index)
        pg.advance()
        stack.close()  # before the RSS daemon: one daemon at a time on 2 cores
        pg.step(f"daemon RSS for {plan.rss_blocks:,} blocks of 4 KiB")
        r.out.update(bench_rss(plan.rss_blocks))
        pg.advance()
    summarize(r, plan)
    r.out["checks_exact"]["cold_source_calls"] = r.cold.calls if r.cold is not None else 0
    r.out["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return r


def summarize(r: Report, plan: Plan) -> None:
    out, head = r.out, (2 * MIB, plan.head_batch)
    mc = r.limit[head]
    # memcpy_gbs keeps its name: it is the limit the headline ratios divide by (the faster native copy)
    out.update(memcpy_gbs=round(mc, 3), limit_gbs=round(mc, 3), limit_threads=out["limit_threads_by_config"][
        f"2 MiBx{plan.head_batch}"], limit_kind="kvstore._native.copy_addrs, faster of threads=1 and 2",
        arena_copy_threads=DEFAULT_THREADS, head_config=f"2 MiB x {plan.head_batch}")
    for suffix, label in (("", f"t{DEFAULT_THREADS}"), ("_grpc", "grpc")):
        for op in ("put", "get"):
            g = r.arena[(op, *head, label)]
            out[f"arena_{op}_gbs{suffix}"] = round(g, 3)
            out[f"arena_{op}_ratio{suffix}"] = round(g / mc, 3)
            for size in SIZES:
                out[f"{op}_{_short(size)}_gbs{suffix}"] = round(r.arena[(op, size, 1, label)], 3)
    out["memcpy_gbs_by_config"] = {f"{fmt_bytes(s)}x{n}": round(v, 3) for (s, n), v in r.limit.items()}
    out["arena_gbs_by_config"] = {f"{op} {fmt_bytes(s)}x{n} {lab}": round(v, 3) for (op, s, n, lab), v in r.arena.items()}
    out["arena_ratio_by_config"] = {f"{op} {fmt_bytes(s)}x{n} {lab}": round(v / r.limit[(s, n)], 3)
                                    for (op, s, n, lab), v in r.arena.items()}
    out["phases_us_p50"] = r.phases
    out["targets"] = evaluate(TARGETS, out)
    out["targets_met"] = {k: v["pass"] for k, v in out["targets"].items()}


def print_report(r: Report) -> None:
    out = r.out

    def judged(row: list[Any]) -> list[Any]:
        return [*row[:-1], "; ".join(filter(None, (mark(TARGETS, out, f) for f in row[-1])))]
    rows = [judged(x) for x in r.rows]
    rows.append([f"daemon RssAnon per block ({out['n_blocks_rss']:,} x 4 KiB, 32 B keys)", "", "", "",
                 f"{out['bytes_per_block']:.1f} B", "", mark(TARGETS, out, "bytes_per_block")])
    print_table("kvstore micro-benchmarks: bytes (p50 / p90 in µs; GB/s from p50; ratio = over the limit of the "
                "same configuration: the faster of kvstore's native copy at 1 and 2 threads)",
                ["measurement", "iters", "p50 µs", "p90 µs", "GB/s", "ratio", "target"], rows)
    print_table(f"control plane (µs; hot = consecutive calls, cold = each call after {out['control_cold_gap_ms']:g} ms "
                f"idle; × raw = p50 over the raw unix socket's p50 for the same frames: {out['uds_request_bytes']} B "
                f"request / {out['uds_reply_bytes']} B reply, or empty for echoes; targets on hot)",
                ["measurement", "iters", "hot p50", "p90", "p99", "× raw", "cold p50", "× raw", "target"],
                [judged(x) for x in r.control_rows])
    tail = ["total", "daemon CPU", "client CPU"]
    ph = r.phases
    ph_cols = sorted({k for v in ph.values() for k in v} - set(tail)) + tail
    print_table("where the time goes (columns: calls, copy_threads=1, fast path unless marked; wall µs p50 per "
                "call of each phase; CPU µs mean per call)", ["phase", *ph], [[c, *(v.get(c, "") for v in ph.values())]
                                                                       for c in ph_cols])
    print_table("targets", ["target", "value", "met", "from"],
                [[f"{k} {v['op']} {v['bound']:g}", v["value"], "PASS" if v["pass"] else "MISS", v["source"]]
                 for k, v in out["targets"].items()] + [["headline arena copy_threads", DEFAULT_THREADS, "", ""]])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations and 200,000 RSS blocks (< 90 s)")
    ap.add_argument("--json-out", metavar="FILE", help="also write the final JSON object to FILE")
    ap.add_argument("--rss-blocks", type=int, metavar="N", help="override N for the RSS measurement")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.rss_blocks:
        plan = dataclasses.replace(plan, rss_blocks=args.rss_blocks)
    r = run(plan)
    r.out["quick"] = args.quick
    print_report(r)
    emit_json(r.out, args.json_out)
    return r.out


if __name__ == "__main__":
    main()
