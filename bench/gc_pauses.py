"""Lookup tails and Python's garbage collector: the daemon's settled heap (kvstore/server/heap.py) against
CPython's defaults, with a collector that never runs as the limit, in one run.

Three clusters of three daemons on one real etcd, the same blocks stored in each:

    no collector   the limit: daemons started with gc.disable() (bench-only, through this script's
                   --daemon-argv launcher): no pause at all, everything else the same
    settled        the shipped default: startup objects frozen, young threshold gc_young_threshold (10,000)
    defaults       gc_young_threshold = 0: CPython's 700 / 10 / 10, nothing frozen

Each cluster stores 20,000 blocks of 4 KiB, put in batches at its nodes in turn (each goes to its owner:
replication "owner"); then, round-robin over the clusters in blocks of 25 calls (the first untimed: every
case hot alike, see bench/_common.interleave), a client on each node in turn loads 64 blocks (a leased prefix
Lookup, then its Release): 40 that node owns, 16 a peer owns (fetched in the call: the fetch path's
allocations), 8 held nowhere (probed at their owners). Every answer is checked (exactly the 56 held blocks
lead); the fetched copies are deleted again, untimed, so every load fetches. Every daemon
records its collector passes (gc.callbacks) and writes them at exit: passes per 1,000 Lookups and the longest.

A Lookup at N nodes waits for the slowest of N - 1 peers, so one peer's pause is every asker's tail: p99,
p99.9 and the worst load are reported beside the passes each case's daemons ran during the loads. The last
stdout line is one JSON object.

    python -m bench.gc_pauses [--quick]
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any

from bench._common import Case, emit_json, interleave, print_table
from kvstore.peer.placement import owners_of

NS = "gc@bench/t"
BLOCK = 4096
NODES = 3
CASES = {"no collector": None, "settled": 10_000, "defaults": 0}   # case -> gc_young_threshold (None: gc off)


def daemon_main(argv: list[str], out_path: str, disable: bool) -> int:
    """The daemon with its collector passes recorded as (generation, start, seconds) on perf_counter's clock
    (CLOCK_MONOTONIC: one clock for every process on the box), and, for the limit, the collector off."""
    passes: list[tuple[int, float, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes.append((info["generation"], started[0], time.perf_counter() - started[0]))
    gc.callbacks.append(on_gc)

    def dump() -> None:
        with open(out_path, "w") as fh:
            json.dump(passes, fh)
    atexit.register(dump)
    if disable:
        gc.disable()   # heap.settle is not called with a threshold (0 is passed) and never turns it on
    from kvstore.server.main import main
    return main(argv)


def _cluster(stack: ExitStack, etcd: Any, threshold: int | None, tmp: str, name: str) -> tuple[list[Any], list[str]]:
    from kvstore.testing import DaemonProcess, peer_options, wait_until
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    clients, logs = [], []
    for i in range(NODES):
        opts: dict[str, Any] = peer_options(etcd, plane="tcp", ttl_s=5.0, timeout_s=2.0,
                                            prefix=f"/gc-{name.replace(' ', '-')}/")
        opts["gc_young_threshold"] = threshold or 0
        d = DaemonProcess(arena_bytes="256MiB", env=env, **opts)
        out = os.path.join(tmp, f"{name.replace(' ', '-')}-{i}.json")
        d.args[1:3] = ["-m", "bench.gc_pauses", "--events-out", out, *(["--no-gc"] if threshold is None else []),
                       "--daemon-argv"]
        stack.enter_context(d)
        clients.append(stack.enter_context(d.client()))
        logs.append(out)
    for c in clients:
        c.register_namespace(NS, model="m", layout_digest="d", tenant="t")
        wait_until(lambda c=c: len(c.health().peers.members) == NODES, 20, what=f"{name}: all members")
    return clients, logs


def _loads(clients: list[Any], held: list[list[bytes]], rnd: random.Random, turn: list[int]) -> Case:
    """A load per call (a leased prefix Lookup), from each node's client in turn: 40 blocks that node owns, 16
    a peer owns (fetched in the call), 8 held nowhere (probed at their owners); the lease released. Untimed
    after it: the 16 fetched copies deleted at the asker, so the next load fetches again. `turn[0]` counts."""
    asked: list[tuple[Any, list[bytes]]] = []

    def one(_: object) -> None:
        node = turn[0] % len(clients)
        turn[0] += 1
        peer = rnd.choice([i for i in range(len(clients)) if i != node])
        remote = rnd.sample(held[peer], 16)
        ask = rnd.sample(held[node], 40) + remote + [rnd.randbytes(16) for _ in range(8)]
        c = clients[node]
        lease = c.lookup(NS, ask, prefix=True)
        c.release([lease])
        if lease.num_prefix != 56:
            raise RuntimeError(f"a load found {lease.num_prefix} of the 56 held blocks that lead")
        asked.append((c, remote))

    def forget(_: object) -> None:
        c, remote = asked.pop()
        c.delete(NS, remote)
    return Case(one, teardown=forget)


def _quantile(xs: tuple[float, ...], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _passes(paths: list[str], t0: float, t1: float) -> tuple[int, float]:
    """Collector passes that started between t0 and t1 (the Lookups), summed over the daemons, and the longest."""
    n, longest = 0, 0.0
    for p in paths:
        with open(p) as fh:
            met = [dur for _, start, dur in json.load(fh) if t0 <= start <= t1]
        n += len(met)
        longest = max([longest, *met])
    return n, longest


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if "--daemon-argv" in argv:   # an instrumented daemon (started by the run below)
        i = argv.index("--daemon-argv")
        head = argv[:i]
        sys.exit(daemon_main(argv[i + 1:], head[head.index("--events-out") + 1], "--no-gc" in head))
    ap = argparse.ArgumentParser(prog="python -m bench.gc_pauses", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer loads (8,000 blocks; about half a minute)")
    ap.add_argument("--json-out", help="also write the JSON line to this file")
    args = ap.parse_args(argv)
    from kvstore.testing import EtcdProcess, etcd_binary, wait_until
    if etcd_binary() is None:
        raise SystemExit("bench.gc_pauses needs etcd: apt-get install -y etcd-server")
    blocks = 8_000 if args.quick else 20_000
    rnd = random.Random(7)
    keys = [rnd.randbytes(16) for _ in range(blocks)]
    value = bytes(BLOCK)
    logs: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstore-gc-pauses-") as tmp:
        with ExitStack() as stack:
            etcd = stack.enter_context(EtcdProcess())
            cases: dict[str, Case] = {}
            calls: dict[str, list[int]] = {}
            for name, threshold in CASES.items():
                clients, logs[name] = _cluster(stack, etcd, threshold, tmp, name)
                for j in range(0, blocks, 256):
                    part = keys[j:j + 256]
                    clients[j // 256 % NODES].put_many(NS, part, [value] * len(part))
                for c in clients:   # every block at its owner before the first Lookup
                    wait_until(lambda c=c: c.stats().peers.pending_pushes == 0, 60, 0.05, f"{name}: pushes")
                ids = [c.health().node_id for c in clients]
                held = [[k for k, o in zip(keys, owners_of(NS, keys, ids, 1)) if o[0] == i] for i in ids]
                calls[name] = [0]
                cases[name] = _loads(clients, held, rnd, calls[name])
            t0 = time.perf_counter()
            res = interleave(cases, warmup=20, min_iters=40 if args.quick else 120, budget_s=0.0, block=25,
                             untimed_in_block=1)
            t1 = time.perf_counter()
        passes = {name: _passes(paths, t0, t1) for name, paths in logs.items()}   # written at the daemons' exit
    lookups = {name: c[0] for name, c in calls.items()}
    limit = res["no collector"].p99
    out: dict[str, Any] = {"blocks": blocks, "nodes": NODES, "loads_per_case": lookups["settled"],
                           "timed_per_case": len(res["settled"])}
    out["p50_ms"] = {k: round(s.p50 * 1e3, 3) for k, s in res.items()}
    out["p99_ms"] = {k: round(s.p99 * 1e3, 3) for k, s in res.items()}
    out["p999_ms"] = {k: round(_quantile(s.seconds, 0.999) * 1e3, 3) for k, s in res.items()}
    out["max_ms"] = {k: round(max(s.seconds) * 1e3, 3) for k, s in res.items()}
    out["settled_p99_over_limit"] = round(res["settled"].p99 / limit, 3)
    out["defaults_p99_over_limit"] = round(res["defaults"].p99 / limit, 3)
    out["defaults_p99_over_settled"] = round(res["defaults"].p99 / res["settled"].p99, 3)
    out["gc_passes_per_1000_loads"] = {k: round(1000 * passes[k][0] / max(1, lookups[k]), 1) for k in res}
    out["gc_longest_pass_ms"] = {k: round(passes[k][1] * 1e3, 2) for k in res}
    rows = [[k + (" (the limit)" if k == "no collector" else ""), f"{s.p50 * 1e3:.2f}", f"{s.p99 * 1e3:.2f}",
             f"{s.p99 / limit:.2f}", out["p999_ms"][k], out["max_ms"][k], out["gc_passes_per_1000_loads"][k],
             out["gc_longest_pass_ms"][k]]
            for k, s in res.items()]
    print_table(f"loads (leased prefix Lookups of 64 keys, 16 fetched from a peer) over {NODES} daemons, "
                f"{blocks} blocks held; ms",
                ["case", "p50", "p99", "p99 / limit", "p99.9", "max", "gc passes / 1k loads", "longest pass"],
                rows)
    emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    main()
