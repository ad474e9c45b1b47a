"""`python -m bench.cluster`: a real etcd and N = 1, 2, 4, 8 real daemons sharing capacity C, replaying agent
sessions, against one node with capacity C over the same requests; then the same through churn.

Runs, all in one process run (the reference and every cluster see the same requests):
  reference   one daemon with C (RAM, in blocks), alone: the hit rate capacity C gives these requests
  steady      for each N and each spread (round-robin over the nodes; by session), N daemons with C / N each,
              replication `owner` (the default): hit rate against the reference, scheduler-lookup p50 / p99,
              peer bytes (fetched + pushed + handed off, counted where they landed) per served byte
  churn       at each --churn-nodes N, by session: a node joins, one is killed (-9), one leaves (SIGTERM), one
              is restarted, at 20/40/60/80 % of the requests (churn.py): failed calls, wrong blocks, the
              hit-rate dip and the seconds until it is back; a PNG of hit rate over time, events marked

C is --capacity-share of the requests' unique blocks, raised where needed so that every node of the largest
cluster holds the largest request twice over (a load lands the blocks it fetches in the reading node's RAM).
Workloads: AgentX sessions (bench/replay/agentx.py), or the conversation trace
(../shared/data/conversation_trace.jsonl, its first --window-s seconds). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from bench._common import emit_json, progress
from bench.cluster.churn import Churn, costs, noise
from bench.cluster.drive import Record, by_session, drive, round_robin
from bench.cluster.report import churn_table, plot_churn, steady_table
from bench.cluster.rig import Rig, RigConfig, single
from bench.replay.agentx import AgentXParams, generate
from bench.replay.keys import chain_keys
from bench.replay.trace import DEFAULT_TRACE, Request, load_trace

__all__ = ["main"]

ROUTES = {"round-robin": round_robin, "session": by_session}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", choices=("agentx", "trace"), default="agentx")
    p.add_argument("--sessions", type=int, default=100, help="AgentX sessions")
    p.add_argument("--scale", type=float, default=0.25, help="AgentX token scale")
    p.add_argument("--window-s", type=float, default=900.0, help="trace: replay its first S seconds")
    p.add_argument("--nodes", default="1,2,4,8", help="cluster sizes of the steady runs")
    p.add_argument("--spreads", default="round-robin,session", help="how requests are spread over the nodes")
    p.add_argument("--churn-nodes", default="4,8", help="cluster sizes of the churn runs ('' for none)")
    p.add_argument("--churn-rate", type=float, default=40.0,
                   help="requests per second in the churn runs (0: back to back): each event then has the same "
                        "seconds to land and recover in however fast this box replays")
    p.add_argument("--capacity-share", type=float, default=0.25, help="C as a share of the unique blocks")
    p.add_argument("--block-kib", type=int, default=32, help="bytes of one block (KiB; a 512-token block)")
    p.add_argument("--replication", choices=("owner", "owner+1"), default="owner")
    p.add_argument("--local-copies", choices=("drop", "guest", "keep"), default="drop",
                   help="the daemons' peer_local_copies (kvstore/peer/guests.py), for an A/B")
    p.add_argument("--quick", action="store_true",
                   help="AgentX 40 sessions, N = 1, 2, 4, churn at 4, one spread (by session)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="directory for the plots")
    return p


def _requests(a: argparse.Namespace) -> tuple[str, list[Request]]:
    if a.workload == "agentx":
        p = AgentXParams(sessions=a.sessions, scale=a.scale)
        return f"agentx(sessions={p.sessions},scale={p.scale:g})", generate(p)
    reqs = load_trace(DEFAULT_TRACE, window_s=a.window_s)
    return f"{DEFAULT_TRACE.name} (first {a.window_s:g} s)", reqs


def _capacity(a: argparse.Namespace, reqs: list[Request], most_nodes: int) -> tuple[int, int]:
    """(C in blocks, the unique blocks of the requests)."""
    unique: set[bytes] = set()
    largest = 0
    for r in reqs:
        keys = chain_keys(r.cacheable_ids())
        unique.update(keys)
        largest = max(largest, len(keys))
    return max(int(a.capacity_share * len(unique)), most_nodes * 2 * largest), len(unique)


def _summary(recs: list[Record], ref: list[int], block_bytes: int, peer: dict[str, int]) -> dict:
    hits, blocks = sum(r.hit for r in recs), sum(r.blocks for r in recs)
    lookups = sorted(r.lookup_s for r in recs)
    moved = peer.get("fetched_blocks", 0) + peer.get("received_pushes", 0) + peer.get("handoff_received", 0)
    return {"hit_rate": round(hits / blocks, 4) if blocks else 0.0,
            "vs_single": round(hits / sum(ref), 4) if sum(ref) else 0.0,
            "lookup_p50_ms": round(1000 * statistics.median(lookups), 3),
            "lookup_p99_ms": round(1000 * lookups[min(len(lookups) - 1, int(0.99 * len(lookups)))], 3),
            "peer_bytes_per_served": round(moved / hits, 4) if hits else 0.0,
            "peer_bytes": moved * block_bytes, "failed_calls": sum(r.failed for r in recs),
            "wrong_blocks": sum(r.wrong for r in recs), "wall_s": round(recs[-1].t, 1) if recs else 0.0}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.sessions, a.nodes, a.churn_nodes, a.spreads = 40, "1,2,4", "4", "session"
    nodes = [int(x) for x in a.nodes.split(",") if x]
    churn_nodes = [int(x) for x in a.churn_nodes.split(",") if x]
    spreads = [s for s in a.spreads.split(",") if s]
    if (not nodes or any(n < 1 for n in nodes) or any(n < 3 for n in churn_nodes) or set(spreads) - set(ROUTES)
            or not 0 <= a.churn_rate < 1e6):
        print("--nodes: sizes >= 1; --churn-nodes: sizes >= 3 (a join, a kill and a leave need three); --spreads: "
              f"{', '.join(ROUTES)}; --churn-rate: 0 (back to back) or requests per second", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    name, reqs = _requests(a)
    block_bytes = a.block_kib << 10
    capacity, unique = _capacity(a, reqs, max(nodes + churn_nodes))
    cfg = RigConfig(block_bytes, capacity, a.replication, local_copies=a.local_copies)
    print(f"{name}: {len(reqs)} requests, {unique} unique blocks of {a.block_kib} KiB; C = {capacity} blocks "
          f"({capacity / unique:.2f} of unique)", file=sys.stderr)
    out: dict = {"workload": name, "requests": len(reqs), "unique_blocks": unique, "capacity_blocks": capacity,
                 "block_bytes": block_bytes, "replication": a.replication, "local_copies": a.local_copies,
                 "churn_rate": a.churn_rate,
                 "steady": {}, "churn": {}}
    rows: list[dict] = []
    tables = []
    with progress(1 + len(nodes) * len(spreads) + len(churn_nodes)) as bar:
        bar.step("one node with C")
        with ExitStack() as stack:
            client = single(stack, cfg)
            ref = [r.hit for r in drive(reqs, block_bytes, {"one": client}, lambda r, i, live: "one")]
        out["single_hit_rate"] = round(sum(ref) / sum(len(r.cacheable_ids()) for r in reqs), 4)
        bar.advance()
        for spread in spreads:
            for n in nodes:
                bar.step(f"{n} nodes, {spread}")
                out["steady"][f"{spread}/{n}"] = s = _steady(reqs, cfg, n, spread, ref)
                rows.append({"spread": spread, "nodes": n, **s})
                bar.advance()
        for n in churn_nodes:
            bar.step(f"churn at {n} nodes")
            out["churn"][str(n)], cs = _churn(reqs, cfg, n, ref, a.out, a.churn_rate)
            tables.append((n, cs))
            bar.advance()
    steady_table(rows)
    for n, cs in tables:
        churn_table(n, cs)
    _headline(out, spreads)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    emit_json(out)
    return 0


def _steady(reqs: list[Request], cfg: RigConfig, n: int, spread: str, ref: list[int]) -> dict:
    with ExitStack() as stack:
        rig = Rig(stack, cfg, n)
        recs = drive(reqs, cfg.block_bytes, rig.clients, ROUTES[spread], lock=rig.route_lock)
        return _summary(recs, ref, cfg.block_bytes, rig.counters())


def _churn(reqs: list[Request], cfg: RigConfig, n: int, ref: list[int], out_dir: Path,
           rate: float) -> tuple[dict, list]:
    with ExitStack() as stack:
        rig = Rig(stack, cfg, n)
        churn = Churn(rig, len(reqs))
        recs = drive(reqs, cfg.block_bytes, rig.clients, by_session, lock=rig.route_lock,
                     on_request=churn.on_request, rate=rate)
        churn.finish()
        s = _summary(recs, ref, cfg.block_bytes, rig.counters())
    cs = costs(churn.events, recs, ref)
    tolerance = noise(churn.events, recs, ref)
    png = plot_churn(out_dir / f"cluster_churn_{n}.png", n, recs, ref, churn.events)
    events = [{"kind": c.kind, "node": c.node, "at_s": round(c.at_s, 2), "took_s": round(c.took_s, 2),
               "failed_calls": c.failed, "wrong_blocks": c.wrong, "level_before": c.level, "level_after": c.after,
               "dip": c.dip,
               "back_s": c.back_s, "error": ev.error} for c, ev in zip(cs, churn.events)]
    return {**s, "plot": str(png), "back_tolerance": round(tolerance, 4), "events": events}, cs


def _headline(out: dict, spreads: list[str]) -> None:
    """The issue's targets, read off the runs: N = 4 against one node, lookup p99 at 8 against 2, churn."""
    steady = out["steady"]
    for spread in spreads:
        if f"{spread}/4" in steady:
            out[f"n4_vs_single_{spread}"] = steady[f"{spread}/4"]["vs_single"]
        if f"{spread}/8" in steady and f"{spread}/2" in steady:
            out[f"lookup_p99_8_over_2_{spread}"] = round(
                steady[f"{spread}/8"]["lookup_p99_ms"] / steady[f"{spread}/2"]["lookup_p99_ms"], 3)
    events = [e for c in out["churn"].values() for e in c["events"]]
    if events:
        out["churn_failed_calls"] = sum(e["failed_calls"] for e in events)
        out["churn_wrong_blocks"] = sum(e["wrong_blocks"] for e in events)
        backs = [e["back_s"] for e in events]
        out["churn_max_back_s"] = None if None in backs else max(backs)
